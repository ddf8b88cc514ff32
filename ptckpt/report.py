"""A campaign's report.html: one self-contained page (no scripts, no fetches: readable
offline) beside results.csv and results.json, holding

- the campaign's parameters (results.json's "campaign": image, inject specs, seeds, runs,
  jobs, timeout, check, restore options, backend, ptckpt version, date) and the reference
  run's stdout signature with a link to its output;
- the fault sites: every flipped bit by symbol (or register) and word, in numeric order,
  with the outcomes of the runs that flipped it; faults that set values apart;
- one chart (inline SVG): a strip per word flipped at least once, a cell per bit, coloured
  by the outcomes of the runs that flipped that bit;
- a histogram of run times and the table of runs, each with links to its stdout, stderr and
  faults.json and the command that makes it again.

A word is 8 bytes from the start of the fault's target (the symbol, or NAME+OFF as the
spec named it); a target shorter than 8 bytes is one word of its own size, and the last
word of a target whose size is not a multiple of 8 is as long as what is left.
"""

from __future__ import annotations

import html
import os
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from .campaign_types import OUTCOMES, CampaignResult, RunResult, fault_text

COLOURS = {"masked": "#4c9a2a", "detected": "#1f6fb2", "crashed": "#c2410c", "hung": "#a16207",
           "error": "#6b7280", "reference": "#000000"}
WORD_BITS = 64
MAX_STRIPS = 256            # the chart's strips at most (the site table lists every bit)
CELL, STRIP, LABEL_W = 9, 12, 190


def _natural(text: str) -> list:
    """Sort key: digits as numbers ("table+8" before "table+16")."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def _size_bits(fault: dict) -> int:
    """How many bits the fault's target has: a register 64, memory its bytes (the hex of
    `before` spans them all), else as far as the highest bit flipped."""
    if fault["target"].startswith("register ") or fault["before"].startswith("0x"):
        return 64
    return len(fault["before"]) * 4 or max(fault["bits"]) + 1


def _word_bits(size: int, word: int) -> int:
    """The bits of word `word` of a target of `size` bits (WORD_BITS, less at the end)."""
    return min(WORD_BITS, size - word * WORD_BITS)


@dataclass
class Site:
    """One bit of one target: the outcomes of the runs that flipped it."""

    outcomes: Counter = field(default_factory=Counter)
    runs: list[int] = field(default_factory=list)


@dataclass
class Sites:
    """The bits flipped in a campaign, by target label -> word -> bit in the word."""

    size: dict[str, int] = field(default_factory=dict)                 # label -> its size in bits
    bits: dict[tuple[str, int, int], Site] = field(default_factory=lambda: defaultdict(Site))
    values: dict[tuple[str, str], Site] = field(default_factory=lambda: defaultdict(Site))
    multi: int = 0                                                     # runs flipping more than one bit

    def words(self) -> list[tuple[str, int]]:
        """(label, word) of every word with a bit flipped, in order."""
        return sorted({(label, word) for label, word, _bit in self.bits}, key=lambda lw: (_natural(lw[0]), lw[1]))


def _label(fault: dict, several_processes: bool) -> str:
    return f"{fault['target']} (process {fault['pid']})" if several_processes else fault["target"]


def collect_sites(runs: list[RunResult]) -> Sites:
    """Every fault of every run by where it went: bits by (label, word, bit in the word),
    values set by (label, value)."""
    sites = Sites()
    several = len({f["pid"] for r in runs for f in r.faults}) > 1
    for run in runs:
        flipped = 0
        for fault in run.faults:
            label = _label(fault, several)
            if not fault["bits"]:
                site = sites.values[(label, fault["after"])]
                site.outcomes[run.outcome] += 1
                site.runs.append(run.index)
                continue
            sites.size[label] = max(sites.size.get(label, 0), _size_bits(fault))
            for bit in fault["bits"]:
                site = sites.bits[(label, bit // WORD_BITS, bit % WORD_BITS)]
                site.outcomes[run.outcome] += 1
                site.runs.append(run.index)
                flipped += 1
        sites.multi += flipped > 1
    return sites


def _counts_text(counts: Counter) -> str:
    return ", ".join(f"{counts[o]} {o}" for o in OUTCOMES if counts.get(o))


def _cell(x: float, y: float, label: str, word: int, bit: int, site: Site | None) -> str:
    """One bit's cell: grey when no run flipped it, else stacked by outcome counts."""
    if site is None:
        return (f'<rect x="{x}" y="{y}" width="{CELL - 1}" height="{STRIP}" fill="#f3f4f6" stroke="#d1d5db" '
                f'stroke-width="0.5"><title>{html.escape(label)} word {word} bit {bit}: not flipped</title></rect>')
    total = sum(site.outcomes.values())
    data = ",".join(f"{o}={site.outcomes[o]}" for o in OUTCOMES if site.outcomes.get(o))
    out = [f'<g class="cell" data-site="{html.escape(label)}" data-word="{word}" data-bit="{bit}" '
           f'data-outcomes="{data}"><title>{html.escape(label)} word {word} bit {bit} '
           f'(bit {word * WORD_BITS + bit}): {_counts_text(site.outcomes)}</title>']
    top = float(y)
    for outcome in OUTCOMES:
        n = site.outcomes.get(outcome, 0)
        if n:
            h = STRIP * n / total
            out.append(f'<rect x="{x}" y="{top:.2f}" width="{CELL - 1}" height="{h:.2f}" '
                       f'fill="{COLOURS[outcome]}"/>')
            top += h
    out.append("</g>")
    return "".join(out)


def bit_chart(sites: Sites) -> str:
    """THE chart: a strip per word flipped at least once (at most MAX_STRIPS), bit 0 (the
    least significant bit of the word's first byte) at the left."""
    words = sites.words()
    if not words:
        return "<p>No run flipped a bit.</p>"
    shown = words[:MAX_STRIPS]
    top = 16
    width = LABEL_W + WORD_BITS * CELL + 10
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" '
           f'height="{top + len(shown) * (STRIP + 4) + 4}" role="img" class="bits">']
    for bit in range(0, WORD_BITS, 8):
        out.append(f'<text x="{LABEL_W + bit * CELL}" y="11" font-size="10">{bit}</text>')
    out.append(f'<text x="{LABEL_W + (WORD_BITS - 1) * CELL - 4}" y="11" font-size="10">{WORD_BITS - 1}</text>')
    for i, (label, word) in enumerate(shown):
        y = top + i * (STRIP + 4)
        out.append(f'<text x="0" y="{y + 10}" font-size="11">{html.escape(label)} word {word}</text>')
        for bit in range(_word_bits(sites.size[label], word)):
            out.append(_cell(LABEL_W + bit * CELL, y, label, word, bit, sites.bits.get((label, word, bit))))
    out.append("</svg>")
    note = (f"<p>{len(shown)} of the {len(words)} words flipped are drawn; the table below lists every bit.</p>"
            if len(words) > len(shown) else "")
    return "".join(out) + note


def _run_links(indexes: list[int]) -> str:
    return " ".join(f'<a href="#run-{i}">{i}</a>' for i in indexes)


def _count_cells(counts: Counter) -> str:
    return "".join(f"<td class='n'>{counts.get(o, 0) or ''}</td>" for o in OUTCOMES)


def site_table(sites: Sites) -> str:
    """The bits flipped, grouped by target, then word, in numeric order; then the values set."""
    heads = "".join(f"<th>{o}</th>" for o in OUTCOMES)
    by_word: dict[tuple[str, int], list[int]] = defaultdict(list)
    for label, word, bit in sites.bits:
        by_word[(label, word)].append(bit)
    per_target = Counter(label for label, _word, _bit in sites.bits)
    rows, last = [], ""
    for label, word in sites.words():
        bits = sorted(by_word[(label, word)])
        width = _word_bits(sites.size[label], word)
        for i, bit in enumerate(bits):
            cells = ""
            if label != last:
                cells += f"<td rowspan='{per_target[label]}'>{html.escape(label)}</td>"
                last = label
            if i == 0:
                cells += f"<td rowspan='{len(bits)}'>{word} (bytes {word * 8}-{word * 8 + width // 8 - 1})</td>"
            site = sites.bits[(label, word, bit)]
            rows.append(f"<tr class='site'>{cells}<td class='n'>{bit}</td><td class='n'>{word * WORD_BITS + bit}</td>"
                        f"{_count_cells(site.outcomes)}<td>{_run_links(site.runs)}</td></tr>")
    out = ["<p>No run flipped a bit.</p>" if not rows else
           f"<table class='sites'><tr><th>target</th><th>word</th><th>bit in word</th><th>bit in target</th>{heads}"
           f"<th>runs</th></tr>{''.join(rows)}</table>"]
    if sites.multi:
        out.append(f"<p>{sites.multi} run(s) flipped more than one bit: such a run counts at each of its bits, "
                   f"so its outcome there is not that bit's alone.</p>")
    if sites.values:
        values = sorted(sites.values.items(), key=lambda kv: (_natural(kv[0][0]), _natural(kv[0][1])))
        rows = [f"<tr><td>{html.escape(label)}</td><td>{html.escape(after)}</td>{_count_cells(site.outcomes)}"
                f"<td>{len(site.runs)}</td></tr>" for (label, after), site in values]
        out.append(f"<h3>Values set</h3><table class='values'><tr><th>target</th><th>value</th>{heads}"
                   f"<th>runs</th></tr>{''.join(rows)}</table>")
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


def _links(result: CampaignResult, run: RunResult) -> str:
    names = {"stdout": "stdout", "stderr": "stderr", "faults": "faults.json"}
    return " ".join(f'<a href="{html.escape(path)}">{names[key]}</a>'
                    for key, path in result.outputs(run).items() if path)


def parameters(result: CampaignResult) -> str:
    """The campaign's parameters as a two-column table."""
    c = result.campaign
    if not c:
        return "<p>(no parameters recorded)</p>"

    def code(text: str) -> str:
        return f"<code>{html.escape(text)}</code>"
    ref = c.get("reference")
    reference = (f"stdout signature {code(ref['signature'])}: "
                 f"<a href='{html.escape(ref['stdout'])}'>stdout</a> <a href='{html.escape(ref['stderr'])}'>stderr</a>; "
                 f"{code(result.reproduce(result.reference)['shell'])}" if ref
                 else "none: each run is judged by the check")
    rows = [("image", code(c["image"])), ("inject", "<br>".join(code(s) for s in c["inject"])),
            ("seeds", f"{c['seeds']['first']} to {c['seeds']['last']} (run N: seed {c['seeds']['first']} + N - 1)"),
            ("runs", str(c["runs"])), ("jobs", str(c["jobs"])), ("timeout", f"{c['timeout']:g} s"),
            ("check", code(c["check"]) if c["check"] else "none: stdout compared with the reference run's"),
            ("restore options", code(" ".join(c["restore_args"])) if c["restore_args"] else "none"),
            ("backend", html.escape(c["backend"])), ("runs as", html.escape(result.runs_as)),
            ("network namespace per run", "yes" if c["netns"] else "no"),
            ("ptckpt version", html.escape(c["ptckpt_version"])), ("date", html.escape(c["date"])),
            ("reference run", reference)]
    return "<table class='params'>" + "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows) + "</table>"


def run_table(result: CampaignResult) -> str:
    rows = "".join(
        f"<tr id='run-{r.index}'><td>{r.index}</td><td>{r.seed}</td>"
        f"<td style='color:{COLOURS.get(r.outcome, '#000')}'>{r.outcome}</td>"
        f"<td>{html.escape(r.reason)}</td><td>{html.escape(fault_text(r.faults))}</td>"
        f"<td>{'' if r.status is None else r.status}</td><td>{r.seconds:.3f}</td><td>{html.escape(r.host)}</td>"
        f"<td>{_links(result, r)}</td><td><code>{html.escape(result.reproduce(r)['shell'])}</code></td></tr>"
        for r in result.runs)
    return ("<table class='runs'><tr><th>run</th><th>seed</th><th>outcome</th><th>reason</th><th>faults</th>"
            "<th>status</th><th>seconds</th><th>host</th><th>output</th><th>reproduce</th></tr>" + rows + "</table>")


REPRODUCE_NOTE = """<p>Each run's <em>reproduce</em> command restores the image with the run's
faults and seed, from the directory the campaign ran in, its stdout and stderr on yours: the same
faults, the same stdout and outcome (runs made as copies of a template included: a copy gives
what a restore gives). It is not killed at the timeout and the check is not run; results.json
holds the same command as an argv list ("reproduce").</p>"""


def write_report(result: CampaignResult) -> str:
    """Write OUT/report.html (0600); returns its path."""
    runs = result.runs
    counts = result.counts()
    sites = collect_sites(runs)
    legend = " ".join(f'<span style="color:{COLOURS[o]}">&#9632; {o} {counts.get(o, 0)}</span>' for o in OUTCOMES)
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>ptckpt campaign: {html.escape(result.out)}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse;margin-bottom:1em}}
td,th{{border:1px solid #ccc;padding:2px 6px;font-size:12px;vertical-align:top}}th{{background:#eee;text-align:left}}
td.n{{text-align:right}}code{{font-size:11px;word-break:break-all}}</style></head>
<body>
<h1>Campaign: {len(runs)} runs</h1>
<p>{html.escape(result.summary())}</p>
<h2>Parameters</h2>
{parameters(result)}
<h2>Bits flipped</h2>
<p>{legend} &nbsp; <span style="color:#9ca3af">&#9633; not flipped</span></p>
<p>A strip per word (8 bytes from the target's start) flipped at least once, bit 0 at the left;
a cell's colours are the outcomes of the runs that flipped that bit, in proportion.</p>
{bit_chart(sites)}
<h2>Fault sites</h2>
{site_table(sites)}
<h2>Run times</h2>
{_histogram([r.seconds for r in runs])}
<h2>Runs</h2>
{REPRODUCE_NOTE}
{run_table(result)}
</body></html>
"""
    path = os.path.join(result.out, "report.html")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(page)
    return path
