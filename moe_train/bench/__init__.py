"""Benchmarks: ``python -m moe_train.bench [--quick] [--out DIR]`` (or ``make bench``).

They print and save numbers (``<out>/<UTC timestamp>/results.json`` and ``results.md``);
they are not tests. Sections: ``moe_train.bench.ep`` (expert parallelism on 8 fake CPU
devices: dispatchers, routings, capacity buckets).
"""
