#!/usr/bin/env python3
"""schema.py — checks rendered manifests against the Kubernetes API's object schemas, offline:
the models of the Kubernetes Python client (Debian's python3-kubernetes), which are generated
from the API's OpenAPI document. Every field must exist in its object's schema and hold the
type it names (a string, an integer, a list, an object), required fields must be there, and
enumerated ones hold an allowed value.

Debian bookworm's client (22.6, Kubernetes 1.22) predates autoscaling/v2, which went GA in 1.23
with the fields of autoscaling/v2beta2 unchanged: a v2 HorizontalPodAutoscaler is checked
against the v2beta2 schema there, and the output says so. Kinds with no model are listed.

Usage: schema.py RENDERED.yaml   (exit 1 with one line per problem)"""
import re
import sys

import yaml

try:
    import kubernetes.client as kc
except ImportError:
    sys.exit("schema.py: the kubernetes client is missing (apt-get install python3-kubernetes)")

PRIMITIVE = {"str": str, "int": int, "bool": bool, "float": (int, float), "datetime": str, "date": str}


def model_name(api_version, kind):
    group, _, version = api_version.rpartition("/")
    name = version.capitalize() + kind
    if hasattr(kc, name):
        return name, None
    if api_version == "autoscaling/v2" and hasattr(kc, "V2beta2" + kind):
        return "V2beta2" + kind, "autoscaling/v2beta2 (the same fields; this client predates v2)"
    return None, None


def walk(value, typ, path, errs):
    if value is None:
        return
    m = re.fullmatch(r"list\[(.+)\]", typ)
    if m:
        if not isinstance(value, list):
            errs.append(f"{path}: a list expected")
            return
        for i, v in enumerate(value):
            walk(v, m.group(1), f"{path}[{i}]", errs)
        return
    m = re.fullmatch(r"dict\(([^,]+), (.+)\)", typ)
    if m:
        if not isinstance(value, dict):
            errs.append(f"{path}: a map expected")
            return
        for k, v in value.items():
            walk(v, m.group(2), f"{path}.{k}", errs)
        return
    if typ == "object":  # IntOrString, free-form
        return
    if typ in PRIMITIVE:
        bad = not isinstance(value, PRIMITIVE[typ]) or (typ == "int" and isinstance(value, bool))
        if bad:
            errs.append(f"{path}: {typ} expected, got {type(value).__name__} {value!r}")
        return
    cls = getattr(kc, typ, None)
    if cls is None:
        errs.append(f"{path}: no model {typ}")
        return
    if not isinstance(value, dict):
        errs.append(f"{path}: an object ({typ}) expected")
        return
    attr_of = {json: attr for attr, json in cls.attribute_map.items()}
    for k in value:
        if k not in attr_of:
            errs.append(f"{path}: unknown field {k!r} in {typ}")
    known = {attr_of[k]: v for k, v in value.items() if k in attr_of}
    try:  # the generated setters refuse a missing required field and a value not in an enum
        cls(**known)
    except ValueError as e:
        errs.append(f"{path}: {e}")
    for attr, v in known.items():
        walk(v, cls.openapi_types[attr], f"{path}.{cls.attribute_map[attr]}", errs)


def main():
    docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
    errs = []
    for d in docs:
        what = f"{d.get('kind')}/{d.get('metadata', {}).get('name')}"
        name, note = model_name(d.get("apiVersion", ""), d.get("kind", ""))
        if name is None:
            print(f"schema.py: {what}: no schema for {d.get('apiVersion')} here, not checked")
            continue
        n = len(errs)
        walk(d, name, what, errs)
        if len(errs) == n:
            print(f"schema.py: {what}: valid {name}" + (f", checked as {note}" if note else ""))
    for e in errs:
        print(f"schema.py: {e}", file=sys.stderr)
    sys.exit(1 if errs else 0)


if __name__ == "__main__":
    main()
