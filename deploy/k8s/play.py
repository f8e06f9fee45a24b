#!/usr/bin/env python3
"""play.py — turns the rendered kustomization into one Pod file per pod for `podman kube play`,
doing by hand what Kubernetes would: the Deployment and StatefulSet controllers (pods named
NAME and NAME-0..N-1), the kubelet's downward API and $(VAR) expansion (POD_NAME, POD_IP are
filled in), envFrom a ConfigMap (inlined), Secret and emptyDir volumes (host directories the
caller made), and Service names (hostAliases to the pod behind a Deployment's Service, since no
cluster DNS runs), and restartPolicy OnFailure for Always (see below). Probes, resources and
ports are dropped (ports: see below); podman runs probes through systemd timers and curl,
neither of which is here; the test polls the same endpoints itself.

Kinds it cannot play (NetworkPolicy, PodDisruptionBudget, HorizontalPodAutoscaler, any other)
are skipped with a line on stderr each, after checking that what they name exists: the pods a
selector picks, the named ports a policy admits, the workload an autoscaler scales.

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


def matches(selector, labels):
    return selector.get("matchLabels", {}).items() <= labels.items() and not selector.get("matchExpressions")


def check_unplayed(docs):
    # returns "KIND/NAME: what was checked" for every object no pod carries out
    tmpls = [(d["kind"], d["metadata"]["name"], d["spec"]["template"]) for d in docs
             if d["kind"] in ("Deployment", "StatefulSet")]
    out = []
    for d in docs:
        kind, name = d["kind"], d["metadata"]["name"]
        if kind in ("Deployment", "StatefulSet", "ConfigMap", "Service"):
            continue
        what = f"{kind}/{name}"
        if kind == "NetworkPolicy":
            sel = [t for _, _, t in tmpls if matches(d["spec"]["podSelector"], t["metadata"]["labels"])]
            if not sel:
                sys.exit(f"play.py: {what} selects no pod")
            declared = {p["name"] for t in sel for c in t["spec"]["containers"] for p in c.get("ports", [])}
            for rule in d["spec"].get("ingress", []):
                for src in rule.get("from", []):
                    if "podSelector" in src and "namespaceSelector" not in src and not any(
                            matches(src["podSelector"], t["metadata"]["labels"]) for _, _, t in tmpls):
                        sys.exit(f"play.py: {what} admits pods {src['podSelector']} that no workload makes")
                for port in rule.get("ports", []):
                    if isinstance(port.get("port"), str) and port["port"] not in declared:
                        sys.exit(f"play.py: {what} admits port {port['port']}, which its pods do not declare")
            ports = sorted({str(p.get("port", "any TCP")) for r in d["spec"].get("ingress", []) for p in r.get("ports", [])})
            what += f" (ports {', '.join(ports)} checked against the pods' containerPorts)"
        elif kind == "PodDisruptionBudget":
            if not any(matches(d["spec"]["selector"], t["metadata"]["labels"]) for _, _, t in tmpls):
                sys.exit(f"play.py: {what} selects no pod")
            what += " (its selector picks a workload's pods)"
        elif kind == "HorizontalPodAutoscaler":
            ref = d["spec"]["scaleTargetRef"]
            if (ref["kind"], ref["name"]) not in {(k, n) for k, n, _ in tmpls}:
                sys.exit(f"play.py: {what} scales {ref['kind']}/{ref['name']}, which is not here")
            what += f" (scales {ref['kind']}/{ref['name']}, which is here)"
        out.append(what)
    return out


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
    for what in check_unplayed(docs):
        print(f"play.py: not played (needs a cluster): {what}", file=sys.stderr)

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
