"""A campaign's report.html and results.json: the campaign's parameters, the fault sites by
target and word in numeric order, one chart whose cells are the outcomes of results.csv,
links to files that exist, and a reproduce command that, run, gives the run's stdout."""

from __future__ import annotations

import csv
import datetime
import hashlib
import html.parser
import json
import os
import re
import shlex
import signal
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from ptckpt import __version__
from ptckpt.campaign_types import CampaignResult, RunResult
from ptckpt.report import collect_sites, write_report

from conftest import reap_orphans
from test_clones import campaigner_image  # noqa: F401 - a fixture

INJECT = ["set:symbol=stop,value=1", "flip:symbol=table,bits=1"]


class Page(html.parser.HTMLParser):
    """What the tests read of report.html: the parameters table, the site table's rows, the
    chart's cells, every href and every id."""

    def __init__(self, text: str):
        super().__init__()
        self.params: dict[str, str] = {}
        self.site_rows: list[list[str]] = []
        self.cells: dict[tuple[str, int, int], Counter] = {}
        self.strips: Counter = Counter()      # (site, word) -> cells drawn, flipped or not
        self.hrefs: list[str] = []
        self.ids: set[str] = set()
        self._table = ""
        self._row: list[str] | None = None
        self._text: list[str] | None = None
        self._svg_text: list[str] | None = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a:
            self.ids.add(a["id"])
        if tag == "a":
            self.hrefs.append(a["href"])
        elif tag == "table":
            self._table = a.get("class", "")
        elif tag == "tr":
            self._row = []
        elif tag in ("td", "th") and self._row is not None:
            self._text = []
        elif tag == "g" and a.get("class") == "cell":
            counts = Counter({k: int(v) for k, v in (kv.split("=") for kv in a["data-outcomes"].split(","))})
            self.cells[(a["data-site"], int(a["data-word"]), int(a["data-bit"]))] = counts

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._text is not None and self._row is not None:
            self._row.append("".join(self._text).strip())
            self._text = None
        elif tag == "tr" and self._row is not None:
            if self._table == "params":
                self.params[self._row[0]] = self._row[1]
            elif self._table == "sites" and self._row[0] != "target":
                self.site_rows.append(self._row)
            self._row = None

    def handle_data(self, data):
        if self._text is not None:
            self._text.append(data)


def _strip_cells(page: str) -> Counter:
    """(site, word) -> the cells its strip draws, from the chart's titles."""
    return Counter((m[1], int(m[2])) for m in re.finditer(r"<title>([^<]+?) word (\d+) bit \d+[ :]", page))


def _site_bits(rows: list[list[str]]) -> list[tuple[str, int, int, int]]:
    """The site table's rows as (target, word, bit in word, bit in target), the target and
    word carried down their rowspan."""
    out, target, word = [], "", 0
    for row in rows:                        # [target, [word,]] bit, bit in target, 5 outcomes, runs
        if len(row) == 10:
            target, row = row[0], row[1:]
        if len(row) == 9:
            word, row = int(row[0].split()[0]), row[1:]
        assert len(row) == 8, row
        out.append((target, word, int(row[0]), int(row[1])))
    return out


def _campaign(ptckpt_run, image: Path, out: Path):
    res = ptckpt_run("campaign", "-D", image, "-o", out, "--runs", "12", "--jobs", "2", "--seed", "40",
                     "--timeout", "30s", *(a for spec in INJECT for a in ("--inject", spec)), "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_report_and_results_hold_the_parameters_the_sites_and_a_reproducible_command(
        campaigner_image, ptckpt, tmp_path):  # noqa: F811 - the fixture
    image, _pid = campaigner_image()
    out = tmp_path / "out"
    before = datetime.datetime.now().astimezone()
    printed = _campaign(ptckpt, image, out)
    results = json.loads((out / "results.json").read_text())
    assert {k: v for k, v in printed.items() if k != "out"} == results
    assert {"summary", "runs_as", "reference", "runs", "campaign"} <= set(results)

    # the parameters, in results.json and on the page
    c = results["campaign"]
    assert (c["image"], c["inject"], c["seeds"], c["runs"], c["jobs"], c["timeout"], c["check"]) == \
           (str(image), INJECT, {"first": 40, "last": 51}, 12, 2, 30.0, "")
    assert c["ptckpt_version"] == __version__ and c["backend"] == "local"
    assert before.replace(microsecond=0) <= datetime.datetime.fromisoformat(c["date"]) <= \
        datetime.datetime.now().astimezone()
    ref_stdout = (out / "runs" / "reference" / "stdout").read_bytes()
    assert c["reference"]["signature"] == hashlib.sha256(ref_stdout).hexdigest()[:16] == \
           results["reference"]["signature"]
    page_text = (out / "report.html").read_text()
    page = Page(page_text)
    assert page.params["image"] == str(image)
    assert page.params["inject"] == "".join(INJECT)             # one <code> per line
    assert page.params["seeds"].startswith("40 to 51") and page.params["runs"] == "12"
    assert page.params["ptckpt version"] == __version__ and page.params["date"] == c["date"]
    assert page.params["runs as"] == results["runs_as"] == "copies of a template"
    assert c["reference"]["signature"] in page.params["reference run"]
    assert "runs/reference/stdout" in page.hrefs

    # the chart's cells: the outcomes results.csv gives each flipped bit of `table`
    with open(out / "results.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["outcome"] != "reference"]
    expected: dict[tuple[str, int, int], Counter] = {}
    for r in rows:
        (bit,) = map(int, re.fullmatch(r"stop = \S+; table bits (\d+)", r["faults"]).groups())
        expected.setdefault(("table", bit // 64, bit % 64), Counter())[r["outcome"]] += 1
    assert page.cells == expected
    assert {o for counts in expected.values() for o in counts} == {"masked", "detected"}
    assert page_text.count("<svg") == 2                         # the chart and the run times
    strips = _strip_cells(page_text)
    assert set(strips) == {(s, w) for s, w, _b in expected} and set(strips.values()) == {64}

    # the site table: grouped by word, in numeric order, every bit flipped once listed
    sites = _site_bits(page.site_rows)
    assert sites == sorted(sites, key=lambda s: (s[1], s[2]))
    assert {(t, w, b) for t, w, b, _bit in sites} == set(expected)
    assert all(bit == w * 64 + b for _t, w, b, bit in sites)

    # every link leads somewhere: a file of OUT or a run's row
    for href in page.hrefs:
        if href.startswith("#"):
            assert href[1:] in page.ids, href
        else:
            assert (out / href).is_file(), href
    for run in results["runs"]:
        n = f"{run['index']:04d}"
        assert run["output"] == {"stdout": f"runs/{n}/stdout", "stderr": f"runs/{n}/stderr",
                                 "faults": f"runs/{n}/faults.json"}
        assert all(h in page.hrefs for h in run["output"].values())
        assert shlex.join(run["reproduce"]["argv"]) in run["reproduce"]["shell"]

    # reproduced by hand: a masked run and a detected run give their stdout again
    for outcome in ("masked", "detected"):
        run = next(r for r in results["runs"] if r["outcome"] == outcome)
        got = _reproduce(run["reproduce"]["shell"], tmp_path / f"again-{outcome}")
        assert got.returncode == run["status"] == 0, got
        assert got.stdout == (out / run["output"]["stdout"]).read_bytes()
        assert hashlib.sha256(got.stdout).hexdigest()[:16] == run["signature"]
        (flip,) = [f for f in run["faults"] if f["bits"]]
        assert f"bits {flip['bits'][0]}: {flip['before']} -> {flip['after']}" in got.stderr.decode()


def _reproduce(shell: str, where: Path) -> subprocess.CompletedProcess:
    """Run a reproduce command as a reader would paste it (its stdout and stderr in files),
    its whole session killed if it is still going after a minute."""
    where.mkdir()
    with open(where / "stdout", "wb") as out, open(where / "stderr", "wb") as err:
        proc = subprocess.Popen(["bash", "-c", shell], stdout=out, stderr=err, start_new_session=True)
        try:
            status = proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            reap_orphans()
            pytest.fail(f"the reproduce command did not end: {shell}")
    return subprocess.CompletedProcess(shell, status, (where / "stdout").read_bytes(),
                                       (where / "stderr").read_bytes())


def _run(index: int, outcome: str, *faults: dict) -> RunResult:
    return RunResult(index, 100 + index, 0, 0.1, faults=list(faults), outcome=outcome,
                     reproduce=("ptckpt", "restore", "--seed", str(100 + index)))


def _flip(target: str, size: int, *bits: int, pid: int = 7) -> dict:
    return {"spec": "flip", "pid": pid, "target": target, "address": 4096, "bits": list(bits),
            "before": "00" * size, "after": "00" * size}


def test_sites_sort_as_numbers_and_words_are_as_long_as_the_target(tmp_path):
    """Bit 2 before bit 10 and word 2 before word 10; a 4-byte target is one 32-bit word, the
    last word of a 12-byte one 32 bits, a register 64; a run flipping two bits counts at
    both and is said to; values set are counted apart."""
    runs = [_run(1, "detected", _flip("big", 96, 10)), _run(2, "masked", _flip("big", 96, 2)),
            _run(3, "masked", _flip("big", 96, 640 + 1)), _run(4, "crashed", _flip("big", 96, 128 + 5)),
            _run(5, "masked", _flip("small", 4, 31)), _run(6, "detected", _flip("odd", 12, 70, 95)),
            _run(7, "hung", {"spec": "reg", "pid": 7, "target": "register rax of 7", "address": 0, "bits": [63],
                             "before": "0x0", "after": "0x8000000000000000"}),
            _run(8, "masked", {"spec": "set", "pid": 7, "target": "stop", "address": 8, "bits": [],
                               "before": "00", "after": "01"}, _flip("big", 96, 2))]
    sites = collect_sites(runs)
    assert sites.words() == [("big", 0), ("big", 2), ("big", 10), ("odd", 1), ("register rax of 7", 0),
                             ("small", 0)]
    assert sites.bits[("big", 0, 2)].outcomes == Counter(masked=2) and sites.bits[("big", 0, 2)].runs == [2, 8]
    assert sites.multi == 1 and sites.values[("stop", "01")].runs == [8]
    result = CampaignResult(runs, RunResult(0, 0, None, 0.0, outcome="none"), str(tmp_path))
    page_text = open(write_report(result)).read()
    page = Page(page_text)
    assert _site_bits(page.site_rows) == [("big", 0, 2, 2), ("big", 0, 10, 10), ("big", 2, 5, 133),
                                          ("big", 10, 1, 641), ("odd", 1, 6, 70), ("odd", 1, 31, 95),
                                          ("register rax of 7", 0, 63, 63), ("small", 0, 31, 31)]
    assert _strip_cells(page_text) == {("big", 0): 64, ("big", 2): 64, ("big", 10): 64, ("odd", 1): 32,
                                       ("register rax of 7", 0): 64, ("small", 0): 32}
    assert page.cells[("register rax of 7", 0, 63)] == Counter(hung=1)
    assert "1 run(s) flipped more than one bit" in page_text
    assert "(no parameters recorded)" in page_text
    data = result.as_json()
    assert data["runs"][0]["reproduce"]["argv"] == ["ptckpt", "restore", "--seed", "101"]
    assert data["runs"][0]["reproduce"]["shell"] == "ptckpt restore --seed 101 </dev/null"
    assert data["runs"][0]["output"] == {"stdout": None, "stderr": None, "faults": None}   # none written
