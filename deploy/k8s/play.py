#!/usr/bin/env python3
"""play.py — turns the rendered kustomization into one Pod file per pod for `podman kube play`,
doing by hand what Kubernetes would: the Deployment and StatefulSet controllers (pods named
NAME and NAME-0..N-1), the kubelet's downward API and $(VAR) expansion (POD_NAME, POD_IP are
filled in), envFrom a ConfigMap (inlined), Secret and emptyDir volumes (host directories the
caller made), and Service names (hostAliases to the pod behind a Deployment's Service, since no
cluster DNS runs), and restartPolicy OnFailure for Always (see below). Probes, resources and ports are dropped (ports: see below); podman runs probes through systemd timers
and curl, neither of which is here; the test polls the same endpoints itself.

Usage: play.py RENDERED.yaml OUTDIR --ip POD=IP... --secrets DIR --volumes DIR [--workers N]
Writes OUTDIR/POD.yaml for every pod and prints "POD IP" lines in start order."""
import argparse
import copy
import os
import re
import sys

import yaml


def expand(s, env):
    # the kubelet's $(VAR) expansion; $$(VAR) stays literal
    return re.sub(r"(?<!\$)\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), s)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("rendered")
    ap.add_argument("outdir")
    ap.add_argument("--ip", action="append", default=[], help="POD=IP")
    ap.add_argument("--secrets", required=True)
    ap.add_argument("--volumes", required=True)
    ap.add_argument("--workers", type=int)
    a = ap.parse_args()
    ips = dict(x.split("=", 1) for x in a.ip)
    docs = [d for d in yaml.safe_load_all(open(a.rendered)) if d]
    cms = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}

    pods = []  # (name, labels, pod spec)
    for d in docs:
        if d["kind"] == "Deployment":
            pods.append((d["metadata"]["name"], d["spec"]["template"]))
        elif d["kind"] == "StatefulSet":
            n = a.workers if a.workers is not None else d["spec"].get("replicas", 1)
            pods += [(f"{d['metadata']['name']}-{i}", d["spec"]["template"]) for i in range(n)]
    aliases = []
    for d in docs:
        if d["kind"] != "Service" or d["spec"].get("clusterIP") == "None":
            continue
        sel = d["spec"]["selector"].items()
        for name, tmpl in pods:
            if sel <= tmpl["metadata"]["labels"].items() and name in ips:
                aliases.append({"ip": ips[name], "hostnames": [d["metadata"]["name"]]})
                break

    os.makedirs(a.outdir, exist_ok=True)
    for name, tmpl in pods:
        if name not in ips:
            sys.exit(f"play.py: no --ip for pod {name}")
        spec = copy.deepcopy(tmpl["spec"])
        for c in spec.get("initContainers", []) + spec["containers"]:
            env = {}
            for cm in c.pop("envFrom", []):
                ref = cm["configMapRef"]["name"]
                real = next((k for k in cms if k == ref or k.startswith(ref + "-")), None)
                if real is None:
                    sys.exit(f"play.py: no ConfigMap {ref}")
                env.update(cms[real])
            for e in c.get("env", []):
                if "valueFrom" in e:
                    f = e["valueFrom"]["fieldRef"]["fieldPath"]
                    env[e["name"]] = {"metadata.name": name, "status.podIP": ips[name]}[f]
                else:
                    env[e["name"]] = expand(e.get("value", ""), env)
            c["env"] = [{"name": k, "value": v} for k, v in env.items()]
            for k in ("command", "args"):
                if k in c:
                    c[k] = [expand(x, env) for x in c[k]]
            # podman 4.3 publishes every containerPort on the host's address, all interfaces:
            # the pods are reached at their own addresses on the podman network instead
            for k in ("livenessProbe", "readinessProbe", "startupProbe", "resources", "ports"):
                c.pop(k, None)
        for v in spec.get("volumes", []):
            if "secret" in v:
                path = os.path.join(a.secrets, v.pop("secret")["secretName"])
            elif "emptyDir" in v:
                v.pop("emptyDir")
                path = os.path.join(a.volumes, name, v["name"])
                os.makedirs(path, exist_ok=True)
                os.chmod(path, 0o777)  # an emptyDir's mode
            else:
                continue
            v["hostPath"] = {"path": path, "type": "Directory"}
        spec["hostAliases"] = aliases
        spec["hostname"] = name
        # podman 4.3 gives init containers the pod's restart policy, so under Always one that
        # finished is started again, forever; OnFailure restarts the daemons the same way for
        # every exit kvmesh uses (75 drained, 1, a signal) and leaves a finished init alone
        if spec.get("initContainers") and spec.get("restartPolicy", "Always") == "Always":
            spec["restartPolicy"] = "OnFailure"
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": name, "labels": tmpl["metadata"]["labels"]}, "spec": spec}
        with open(os.path.join(a.outdir, name + ".yaml"), "w") as f:
            yaml.safe_dump(pod, f, sort_keys=False)
        print(name, ips[name])


if __name__ == "__main__":
    main()
