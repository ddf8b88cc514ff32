"""A campaign's report.html: one self-contained page (no scripts, no fetches: readable
offline) beside results.csv and results.json, with the outcome counts, the outcomes by
fault site (the symbol or register and the bit flipped), a histogram of run times, and
the table of runs."""

from __future__ import annotations

import html
import os
from collections import Counter, defaultdict

from .campaign_types import OUTCOMES, CampaignResult, fault_text

COLOURS = {"masked": "#4c9a2a", "detected": "#1f6fb2", "crashed": "#c2410c", "hung": "#a16207",
           "error": "#6b7280", "reference": "#000000"}


def _site(run) -> str:
    """Where a run's fault went: 'design_state bit 116', 'rax bit 3', or its text."""
    if len(run.faults) == 1 and len(run.faults[0].get("bits") or ()) == 1:
        f = run.faults[0]
        return f"{f['target']} bit {f['bits'][0]}"
    return fault_text(run.faults) or "(none)"


def _bars(rows: list[tuple[str, Counter]], width: int = 560) -> str:
    """Stacked horizontal bars, one per row label, coloured by outcome (inline SVG)."""
    if not rows:
        return "<p>(no runs)</p>"
    most = max(sum(c.values()) for _label, c in rows) or 1
    bar_h, label_w = 16, 220
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{label_w + width + 40}" '
           f'height="{len(rows) * (bar_h + 4) + 4}" role="img">']
    for i, (label, counts) in enumerate(rows):
        y = 2 + i * (bar_h + 4)
        out.append(f'<text x="0" y="{y + 12}" font-size="11">{html.escape(label)}</text>')
        x = label_w
        for outcome in OUTCOMES:
            n = counts.get(outcome, 0)
            if n:
                w = n / most * width
                out.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{bar_h}" '
                           f'fill="{COLOURS[outcome]}"><title>{outcome}: {n}</title></rect>')
                x += w
        out.append(f'<text x="{x + 4:.1f}" y="{y + 12}" font-size="11">{sum(counts.values())}</text>')
    out.append("</svg>")
    return "".join(out)


def _histogram(seconds: list[float], bins: int = 20, width: int = 560, height: int = 120) -> str:
    if not seconds:
        return "<p>(no runs)</p>"
    lo, hi = min(seconds), max(seconds)
    span = (hi - lo) or 1.0
    counts = [0] * bins
    for s in seconds:
        counts[min(int((s - lo) / span * bins), bins - 1)] += 1
    top = max(counts)
    w = width / bins
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width + 20}" height="{height + 30}" role="img">']
    for i, n in enumerate(counts):
        h = n / top * height
        out.append(f'<rect x="{i * w:.1f}" y="{height - h:.1f}" width="{w - 1:.1f}" height="{h:.1f}" '
                   f'fill="#1f6fb2"><title>{lo + i * span / bins:.2f}-{lo + (i + 1) * span / bins:.2f} s: '
                   f'{n} run(s)</title></rect>')
    out.append(f'<text x="0" y="{height + 16}" font-size="11">{lo:.2f} s</text>'
               f'<text x="{width - 40}" y="{height + 16}" font-size="11">{hi:.2f} s</text></svg>')
    return "".join(out)


def write_report(result: CampaignResult) -> str:
    """Write OUT/report.html (0600); returns its path."""
    runs = result.runs
    counts = result.counts()
    by_site: dict[str, Counter] = defaultdict(Counter)
    for r in runs:
        by_site[_site(r)][r.outcome] += 1
    sites = sorted(by_site.items(), key=lambda kv: (-sum(kv[1].values()), kv[0]))[:60]
    legend = " ".join(f'<span style="color:{COLOURS[o]}">&#9632; {o} {counts.get(o, 0)}</span>' for o in OUTCOMES)
    rows = "".join(
        f"<tr><td>{r.index}</td><td>{r.seed}</td><td style='color:{COLOURS.get(r.outcome, '#000')}'>{r.outcome}</td>"
        f"<td>{html.escape(r.reason)}</td><td>{html.escape(fault_text(r.faults))}</td>"
        f"<td>{'' if r.status is None else r.status}</td><td>{r.seconds:.3f}</td><td>{html.escape(r.host)}</td></tr>"
        for r in runs)
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>ptckpt campaign: {html.escape(result.out)}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:2px 6px;font-size:12px}}th{{background:#eee}}</style></head>
<body>
<h1>Campaign: {len(runs)} runs</h1>
<p>{html.escape(result.summary())}</p>
<p>{legend}</p>
<h2>Outcomes by fault site</h2>
{_bars(sites)}
<h2>Run times</h2>
{_histogram([r.seconds for r in runs])}
<h2>Runs</h2>
<table><tr><th>run</th><th>seed</th><th>outcome</th><th>reason</th><th>faults</th><th>status</th><th>seconds</th>
<th>host</th></tr>
{rows}
</table>
</body></html>
"""
    path = os.path.join(result.out, "report.html")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(page)
    return path
