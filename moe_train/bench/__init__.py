"""Benchmarks: ``python -m moe_train.bench [--quick] [--out DIR]`` (or ``make bench``).

They print and save numbers (``<out>/<UTC timestamp>/results.json`` and ``results.md``);
they are not tests. Sections: ``moe_train.bench.ep`` (expert parallelism on 8 fake CPU
devices: dispatchers, routings, capacity buckets).

``study`` (``make study``, ``python -m moe_train.study``) trains the dropless MoE against its
baselines end to end on the shipped corpus.

May import anything of the kit but the launcher; nothing of the training path imports it
(the routings it shares with the self-test live in ``moe_train.moe.routings``).
"""
