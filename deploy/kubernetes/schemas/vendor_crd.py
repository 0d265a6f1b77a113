"""Writes one version of a published CustomResourceDefinition's OpenAPI schema as a JSON schema for the offline
manifest check (tests/test_kubernetes.py), the way the files next to this script were made:

    curl -sLO <the CRD's URL at a release tag>
    python deploy/kubernetes/schemas/vendor_crd.py CRD.yaml VERSION URL LICENCE > deploy/kubernetes/schemas/NAME.json

The schema (`spec.versions[VERSION].schema.openAPIV3Schema`) is kept as published: types, enums, patterns,
limits, defaults, required fields and the `x-kubernetes-*` extensions, CEL rules included. Only the
`description` texts are dropped (about three quarters of the size, documentation only). The structural subset of
OpenAPI v3 that CRDs use reads the same as JSON Schema; the test evaluates it with jsonschema, treats unknown
fields as the API server's pruning would (an error here), and does not run the CEL rules.
"""
import json
import sys

import yaml

SCHEMA_MAPS = ("properties", "patternProperties", "definitions", "$defs")  # name -> schema
SCHEMA_LISTS = ("allOf", "anyOf", "oneOf")
SCHEMA_VALUES = ("items", "additionalProperties", "not", "additionalItems")


def without_descriptions(schema):
    """The schema without its `description` keywords; a property that happens to be named `description` stays."""
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "description":
            continue
        if key in SCHEMA_MAPS:
            value = {name: without_descriptions(sub) for name, sub in value.items()}
        elif key in SCHEMA_LISTS:
            value = [without_descriptions(sub) for sub in value]
        elif key in SCHEMA_VALUES:
            value = without_descriptions(value)
        out[key] = value
    return out


def vendor(crd: dict, version: str, url: str, licence: str) -> dict:
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    bundle = next((v for k, v in crd["metadata"].get("annotations", {}).items() if k.endswith("/bundle-version")), "")
    comment = (f"{kind}, {group}/{version}: the openAPIV3Schema of the published CRD {crd['metadata']['name']}"
               f"{' ' + bundle if bundle else ''} ({url}), {licence}; descriptions removed by vendor_crd.py")
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$comment": comment,
            **without_descriptions(served["schema"]["openAPIV3Schema"])}


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    path, version, url, licence = sys.argv[1:]
    with open(path) as f:
        (crd,) = [d for d in yaml.safe_load_all(f) if d and d.get("kind") == "CustomResourceDefinition"]
    json.dump(vendor(crd, version, url, licence), sys.stdout, indent=1)
    sys.stdout.write("\n")
