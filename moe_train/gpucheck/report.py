"""results.md of a gpu-check run: one heading per section, its verdict, numbers and rows."""

from __future__ import annotations

from typing import Any

from moe_train.bench.common import markdown_table

HIDDEN = {"status", "reason", "rows", "seconds", "budget_s", "name", "title", "traceback", "tail"}


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, dict) and v and all(isinstance(x, (int, float)) for x in v.values()):
        worst = max(v, key=lambda k: v[k])  # errors: the worst one
        return f"{worst} {_fmt(v[worst])}"
    if isinstance(v, (list, tuple)):
        return ", ".join(_fmt(x) for x in v) or "-"
    return "-" if v is None else str(v).replace("|", "/").replace("\n", " ")


def _table(rows: list[dict[str, Any]]) -> str:
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols and k not in ("status", "reason", "tail")]
    header = ["status", *cols, "reason"]
    return markdown_table(
        header, [[r.get(c) if c == "status" else _fmt(r.get(c)) for c in header] for r in rows]
    )


def _rows_tables(rows: list[dict[str, Any]]) -> str:
    """One table per kind of row (rows with the same fields, skipped rows with their kind)."""
    groups: list[tuple[set, list[dict]]] = []
    for r in rows:
        keys = set(r) - {"status", "reason"}
        home = next((g for g in groups if keys <= g[0] or g[0] <= keys), None)
        if home is None:
            groups.append((keys, [r]))
        else:
            home[0].update(keys)
            home[1].append(r)
    return "\n\n".join(_table(g) for _, g in groups)


def render(results: dict[str, Any]) -> str:
    out = [
        f"# gpu-check {results['created_utc']}: {results['device_kind']} "
        f"({results['devices']} {results['platform']} device(s)), wall "
        f"{results.get('wall_s', 0):.0f} s\n"
    ]
    out.append(
        markdown_table(
            ["section", "status", "seconds", "reason"],
            [
                [s["name"], s["status"], f"{s['seconds']:.1f}", _fmt(s.get("reason") or "")]
                for s in results["sections"]
            ],
        )
    )
    for i, s in enumerate(results["sections"], 1):
        out.append(f"\n## {i}. {s['title']}: {s['status']} ({s['seconds']:.1f} s of {s['budget_s']:.0f} s)\n")
        if s.get("reason"):
            out.append(f"{s['reason']}\n")
        numbers = {k: v for k, v in s.items() if k not in HIDDEN}
        if numbers:
            out.append("\n".join(f"- {k}: {_fmt(v)}" for k, v in numbers.items()) + "\n")
        if s.get("rows"):
            out.append(_rows_tables(s["rows"]))
        if s.get("traceback"):
            out.append("```\n" + "\n".join(s["traceback"]) + "\n```")
    return "\n".join(out) + "\n"
