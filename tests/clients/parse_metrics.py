"""Parses Prometheus text from stdin with the official client's parser (prometheus_client).

Prints {"<name>{k=v,...}": value} for every sample as JSON; fails on text the parser refuses.
"""
import json
import sys

from prometheus_client.parser import text_string_to_metric_families

samples = {}
for family in text_string_to_metric_families(sys.stdin.read()):
    for s in family.samples:
        labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
        samples[f"{s.name}{{{labels}}}"] = s.value
print(json.dumps(samples))
