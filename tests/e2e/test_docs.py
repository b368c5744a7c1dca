"""Every code block of README.md and docs/*.md runs as written and prints what its page says it prints.

Conventions of the pages (their Markdown source; a reader sees only the blocks):

* A ```python or ```bash block that runs is followed (blank lines apart) by its expected output: a
  ```text block whose first line is ``Output``. The test runs the block and compares its **stdout** with
  the rest of that block. Lines printed by Ray worker processes (``(pid=...)``, ``(raylet)``, ...) are
  left out; stderr is shown when a block fails, never compared.
* In an expected output, a line ``...`` stands for any number of lines, ``...`` inside a line for any
  text, and ``~NUMBER`` for a finite number within 20% of NUMBER (:data:`TOLERANCE`; the page shows the
  value a run of ``make demo``'s study printed; ``~0.31`` matches 0.25-0.37, never ``nan``).
  Runs of spaces match runs of spaces (table columns move with the numbers). A block whose numbers
  depend on the demo's exact pretrained weights (a few inputs through them) may say, on the line above it,
  ``<!-- within 50%: why -->``: its wildcards then admit that fraction (the 300-step pretraining ends at
  other weights on another architecture, its floating-point sums in another order; every x86-64 CPU runs the
  kernels raystudy/cpu_kernels.py pins, tests/e2e/test_cpu_numbers.py).
  A wildcard never stands for ``nan``, ``inf``, ``failed``, ``error`` or a ``Traceback``: a block that
  prints one of them matches only an expected output that spells it out.
* A block that is not run says why, on the line above it: ``<!-- not run: the reason -->``. Every
  ```python and ```bash block has exactly one of the two. Other ```text blocks are listings and are
  not compared; other languages are refused.

The blocks run in a folder holding the study ``make demo`` makes at ``results/demo`` (``conftest.demo_study``:
``experiments/full_study.py`` run as a user runs it), so that every number a page prints is the one a user
of the demo gets, within the tolerance. ``experiments/`` is linked into it, as the
pages run from the repository root, and ``.venv`` is linked to this interpreter's environment. The
python blocks run in page order in one interpreter (Ray starts once), each in a fresh namespace (no
block uses another's names); each bash block runs in its own ``bash -e``, with this interpreter's
``bin`` first on ``PATH`` (``python``, ``raystudy``).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.processes import REPO

#: the pages whose blocks are run, README first
PAGES = ["README.md", *sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md"))]
#: the languages a page may use: run (or say why not), or a listing
RUN_LANGUAGES = ("python", "bash")
LISTING = "text"

FENCE = re.compile(r"^```(\S*)\s*$")
NOT_RUN = re.compile(r"^<!--\s*not run:\s*(\S.*?)\s*-->\s*$")
#: ``<!-- within 50%: why -->`` above a block: its ``~NUMBER`` wildcards admit that fraction, not :data:`TOLERANCE`
WITHIN = re.compile(r"^<!--\s*within\s+(\d+)%:\s*(\S.*?)\s*-->\s*$")
OUTPUT_HEADER = "Output"
#: what a wildcard may not stand for
FORBIDDEN = r"(?:\b[Nn]a[Nn]\b|\binf\b|\bfailed\b|\b[Ee]rror\b|\w+Error\b|Traceback)"
NUMBER = r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?"
_TOKEN = re.compile(r"\.\.\.|~" + NUMBER + r"| +")
#: stdout lines that Ray forwards from its worker and daemon processes
FORWARDED = re.compile(r"^\((?:[\w.:-]+ )?(?:pid=\d+|raylet|autoscaler|gcs_server|monitor)[^)]*\)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")

@dataclass
class Block:
    page: str
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    expected: str | None = None  # the Output block without its header line
    not_run: str | None = None  # the reason given in <!-- not run: ... -->
    tolerance: float | None = None  # a wider tolerance given, with its reason, in <!-- within N%: ... -->

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


# ---------------------------------------------------------------------------------------------------------
# Parsing the pages


def parse_page(page: str, text: str) -> list[Block]:
    """The fenced blocks of ``text``, each Output block attached to the code block right above it."""
    lines, blocks, i = text.splitlines(), [], 0
    previous = ""  # the last non-blank line outside a block
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            previous = lines[i] if lines[i].strip() else previous
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and not FENCE.match(lines[i]):
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise AssertionError(f"{page}:{start + 1}: unclosed code block")
        reason, wider = NOT_RUN.match(previous), WITHIN.match(previous)
        block = Block(page, start + 1, m.group(1), "\n".join(body) + "\n", not_run=reason and reason.group(1),
                      tolerance=int(wider.group(1)) / 100 if wider else None)
        if block.language == LISTING and body and body[0].strip() == OUTPUT_HEADER:
            owner = blocks[-1] if blocks and previous == "```" else None
            if owner is None or owner.language not in RUN_LANGUAGES or owner.expected is not None:
                raise AssertionError(f"{page}:{start + 1}: an Output block that follows no code block")
            owner.expected = "\n".join(body[1:])
        else:
            blocks.append(block)
        previous = "```"
        i += 1
    return blocks


def page_blocks() -> list[Block]:
    return [b for page in PAGES for b in parse_page(page, (REPO / page).read_text(encoding="utf-8"))]


BLOCKS = page_blocks()
PYTHON = [b for b in BLOCKS if b.language == "python" and b.expected is not None]
SHELL = [b for b in BLOCKS if b.language == "bash" and b.expected is not None]


# ---------------------------------------------------------------------------------------------------------
# Matching an output


#: how far a run's number may be from a page's ``~NUMBER``: a fraction of it, or one unit of its last printed
#: digit where that is more (``~0.91`` admits 0.73-1.09; ``~48`` admits 38.4-57.6; ``~0`` admits -1 to 1)
TOLERANCE = 0.2


def within(expected: str, got: str, tolerance: float = TOLERANCE) -> bool:
    """Whether ``got`` is a finite number within ``tolerance`` of ``expected`` (a page's ``~NUMBER``)."""
    want, value = float(expected), float(got)
    decimals = len(expected.split(".")[1].split("e")[0].split("E")[0]) if "." in expected else 0
    return math.isfinite(value) and abs(value - want) <= max(tolerance * abs(want), 10.0 ** -decimals)


def _line_pattern(line: str, numbers: list[str]) -> str:
    out, pos = [], 0
    for m in _TOKEN.finditer(line):
        out.append(re.escape(line[pos:m.start()]))
        token = m.group()
        if token == "...":
            out.append(f"(?:(?!{FORBIDDEN}).)*?")
        elif token.startswith(" "):
            out.append(" +")
        else:
            numbers.append(token[1:])
            out.append(f"({NUMBER})")
        pos = m.end()
    out.append(re.escape(line[pos:]))
    return "".join(out)


def output_pattern(expected: str) -> tuple[re.Pattern, list[str]]:
    """The regular expression an output (lines without trailing spaces, each ending in a newline) must
    match in full to match ``expected``, and the numbers of its ``~NUMBER`` wildcards (one group each)."""
    parts, numbers = [], []
    for line in _clean(expected).splitlines():
        if line.strip() == "...":
            parts.append(f"(?:(?:(?!{FORBIDDEN})[^\\n])*\\n)*?")
        else:
            parts.append(_line_pattern(line, numbers) + r"\n")
    return re.compile("".join(parts)), numbers


def _clean(text: str) -> str:
    """Trailing spaces and the blank lines at both ends removed; every line ends in a newline."""
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return "".join(line + "\n" for line in lines)


def printed(stdout: str) -> str:
    """``stdout`` without the lines Ray forwards from other processes, cleaned as :func:`_clean`."""
    lines = ANSI.sub("", stdout).splitlines()
    return _clean("\n".join(line for line in lines if not FORWARDED.match(line)))


def far_numbers(expected: str, output: str, tolerance: float = TOLERANCE) -> list[str] | None:
    """None when ``output`` does not match ``expected``'s pattern; else the ``~NUMBER`` wildcards whose printed
    number is not :func:`within` tolerance, as ``"~0.91: 0.52"`` (empty: it matches)."""
    pattern, numbers = output_pattern(expected)
    m = pattern.fullmatch(printed(output))
    if m is None:
        return None
    return [f"~{want}: {got}" for want, got in zip(numbers, m.groups()) if not within(want, got, tolerance)]


def matches(expected: str, output: str) -> bool:
    return far_numbers(expected, output) == []


def assert_prints(block: Block, stdout: str, stderr: str = "") -> None:
    tolerance = block.tolerance or TOLERANCE
    far = far_numbers(block.expected, stdout, tolerance)
    if far:
        raise AssertionError(f"{block.id}: the {block.language} block\n{block.code}\nprinted numbers more than "
                             f"{tolerance:.0%} from the page's (page: run):\n" + "\n".join(far)
                             + f"\nin\n{printed(stdout)}")
    if far is None:
        raise AssertionError(f"{block.id}: the {block.language} block\n{block.code}\nprinted\n"
                             f"{printed(stdout) or '(nothing)'}\nwhere the page says\n{_clean(block.expected)}"
                             + (f"\nstderr (last 4000 characters):\n{stderr[-4000:]}" if stderr else ""))


def assert_quiet(block: Block, stdout: str, stderr: str) -> None:
    """No line of Ray's own on stdout or stderr: the library and the CLI keep Ray's logs in its log files."""
    from tests.e2e.test_terminal import ray_lines

    noise = ray_lines(stdout + "\n" + stderr)
    assert not noise, f"{block.id}: Ray's own lines reached the terminal:\n" + "\n".join(noise[:20])


# ---------------------------------------------------------------------------------------------------------
# Checks of the pages themselves (fast)


def test_every_code_block_runs_or_says_why():
    assert PYTHON and SHELL
    for b in BLOCKS:
        assert b.language in (*RUN_LANGUAGES, LISTING), f"{b.id}: language {b.language!r}; use python, bash or text"
        if b.language in RUN_LANGUAGES:
            assert (b.expected is None) != (b.not_run is None), (
                f"{b.id}: a {b.language} block needs either an Output block after it or "
                f"'<!-- not run: why -->' above it (not both)")


def test_readme_is_short_and_maps_every_page():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 150
    for page in sorted((REPO / "docs").glob("*.md")):
        assert f"](docs/{page.name})" in readme, f"README.md does not link docs/{page.name}"
    for command in ("make demo", "make test", "source .venv/bin/activate", "python experiments/full_study.py",
                    ".venv/bin/"):
        assert command in readme, command
    for result in ("trials.parquet", "curves.parquet", "plasticity.parquet", "report.html", "tb/", "probes/",
                   "pretrained/", "data/"):
        assert result in readme, result


def test_pages_have_the_blocks_they_document():
    text = "\n".join(b.code for b in PYTHON)
    for api in ("raystudy.load_study", "restore_tuner", "open_split", "pair_rates", "run_plasticity",
                "run_finetune", "train_local", "analyze", "prepare_default"):
        assert api in text, api
    commands = "\n".join(b.code for b in SHELL)
    for command in ("raystudy study", "raystudy data info", "raystudy data prepare", "raystudy plasticity",
                    "raystudy bounds", "raystudy finetune", "raystudy probe", "raystudy analyze", "raystudy report",
                    "experiments/full_study.py"):
        assert command in commands, command


#: where a page's example may write, relative to the repository root a reader runs it from: folders git ignores
#: (.gitignore) or a temporary one, so that trying the pages leaves the checkout as it was
WRITES = re.compile(r"""--out[ =]["']?([^\s"']+)|\bout(?:_dir)?\s*=\s*["']([^"']+)|prepare_default\(\s*["']([^"']+)""")
SCRATCH = ("results/", "runs/", "/tmp/")


def test_examples_write_only_where_git_looks_away():
    """``raystudy data prepare synthetic --out data/default`` left a data/ folder in the checkout."""
    ignored = (REPO / ".gitignore").read_text(encoding="utf-8").split()
    assert all(folder in ignored for folder in SCRATCH if not folder.startswith("/")), ignored
    written = [(b.id, path) for b in PYTHON + SHELL for m in WRITES.finditer(b.code) for path in m.groups() if path]
    assert len(written) >= 8, written  # every example that writes (--out, out_dir=, prepare_default(...))
    outside = [(where, path) for where, path in written if not path.startswith(SCRATCH)]
    assert not outside, f"examples that write into the checkout: {outside}"


def test_expected_output_wildcards():
    assert matches("ok ~0.3", "ok 0.35\n") and not matches("ok ~0.3", "ok 0.4166\n")  # within 20%, or not
    assert matches("~48 trials", "40 trials\n") and not matches("~48 trials", "12 trials\n")
    assert matches("~0.91", "1.09\n") and not matches("~0.91", "1.1\n") and matches("~0", "1\n")
    assert matches("~2", "3\n") and not matches("~2", "4\n")  # one unit of the last digit where that is more
    assert far_numbers("a ~1.00 b ~5", "a 1.5 b 5\n") == ["~1.00: 1.5"] and far_numbers("a ~1", "b 1\n") is None
    assert matches("ok ~0.3", "ok 0.3\n") and matches("a\n...\nz", "a\nb\nc\nz\n") and matches("a\n...\nz", "a\nz")
    assert matches("x  = ~1 ...", "x = 1.2 and more\n") and matches("x ~2.5e-3", "x 2.6e-3\n")
    assert matches("Output of ...", "Output of it\n")
    assert matches("col    1", "col 1\n") and matches("", "(pid=12) worker chatter\n")
    assert matches("a\nb", "a\n\x1b[36m(RayTrainWorker pid=3)\x1b[0m chatter\n(raylet) more\nb\n")


def test_a_block_may_widen_its_tolerance_saying_why():
    text = ("<!-- within 50%: the toy weights -->\n```bash\necho 1.4\n```\n\n```text\nOutput\n~1.0\n```\n"
            "```bash\necho 1.4\n```\n\n```text\nOutput\n~1.0\n```\n")
    wide, plain = parse_page("page.md", text)
    assert (wide.tolerance, plain.tolerance) == (0.5, None)
    assert far_numbers(wide.expected, "1.4\n", wide.tolerance) == [] and far_numbers(wide.expected, "1.6\n", 0.5)
    with pytest.raises(AssertionError, match="more than 20% from"):
        assert_prints(plain, "1.4\n")
    assert_prints(wide, "1.4\n")


def test_a_wildcard_never_stands_for_a_failure():
    assert not matches("ok ~0.3", "failed nan\n")
    assert not matches("ok ~0.3", "ok nan\n") and not matches("~1", "inf\n") and not matches("~1", "\n")
    assert not matches("status ...", "status failed\n") and not matches("...", "test_acc nan\n")
    assert not matches("a\n...\nz", "a\nTraceback (most recent call last):\nz\n")
    assert not matches("...", "raystudy.data.store.StoreError: not a store\n")
    assert not matches("ok\n...", "ok\nerror   WorkerGroupError: boom\n")
    assert matches("0 failed, ...", "0 failed, 2 ok\n")  # spelt out, it matches


# ---------------------------------------------------------------------------------------------------------
# Running the blocks (slow: a demo study first)


def _run(args: list[str], cwd: Path, timeout: int) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def demo_cwd(demo_study) -> Path:
    """The working directory of the session's demo study (``conftest.demo_study``): the study at
    ``results/demo``, its stores in ``results/demo/data``."""
    assert demo_study["returncode"] == 0, f"{demo_study['stdout']}\n{demo_study['stderr']}"
    cwd = Path(demo_study["cwd"])
    for name in ("trials.parquet", "curves.parquet", "plasticity.parquet", "spec.yaml", "pretrained/model.safetensors"):
        assert (cwd / "results" / "demo" / name).exists(), name  # curves.parquet: a dataset folder
    return cwd


RUNNER = """
import json, sys, time, traceback
blocks = json.load(open(sys.argv[1]))
for i, (name, code) in enumerate(blocks):
    t0, error = time.time(), None
    print("\\0BLOCK-START", flush=True)
    print("\\0BLOCK-START", file=sys.stderr, flush=True)
    try:
        exec(compile(code, name, "exec"), {"__name__": "__main__"})
    except BaseException:
        error = traceback.format_exc()
    sys.stdout.flush()
    print("\\0BLOCK-END", file=sys.stderr, flush=True)
    print("\\0BLOCK-END " + json.dumps({"index": i, "error": error, "seconds": time.time() - t0}), flush=True)
"""


@pytest.fixture(scope="session")
def python_results(demo_cwd) -> dict[int, dict]:
    """``{index in PYTHON: {"error": traceback or None, "stdout": ..., "seconds": ...}}`` of one run of
    every python block, in page order, in one interpreter."""
    (demo_cwd / "blocks.json").write_text(json.dumps([[f"<{b.id}>", b.code] for b in PYTHON]))
    proc = _run([sys.executable, "-c", RUNNER, "blocks.json"], demo_cwd, timeout=1800)
    stderr = [part.split("\0BLOCK-END")[0] for part in proc.stderr.split("\0BLOCK-START\n")[1:]]
    results, lines = {}, []
    for line in proc.stdout.splitlines():
        if line.startswith("\0BLOCK-START"):
            lines = []
        elif line.startswith("\0BLOCK-END "):
            r = json.loads(line[len("\0BLOCK-END "):])
            results[r["index"]] = {**r, "stdout": "\n".join(lines), "stderr": stderr[r["index"]]}
        else:
            lines.append(line)
    assert len(results) == len(PYTHON), f"the runner stopped early:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return results


@pytest.mark.parametrize("index", range(len(PYTHON)), ids=[b.id for b in PYTHON])
def test_python_block_prints_its_output(index, python_results):
    block, result = PYTHON[index], python_results[index]
    assert result["error"] is None, f"{block.id}: the block raised\n{block.code}\n{result['error']}"
    assert_prints(block, result["stdout"], result["stderr"])
    assert_quiet(block, result["stdout"], result["stderr"])


@pytest.mark.parametrize("block", SHELL, ids=[b.id for b in SHELL])
def test_shell_block_prints_its_output(block, demo_cwd):
    proc = _run(["bash", "-e", "-c", block.code], demo_cwd, timeout=900)
    assert proc.returncode == 0, (f"{block.id}: exit status {proc.returncode}\n{block.code}\n"
                                  f"{proc.stdout}\n{proc.stderr[-4000:]}")
    assert_prints(block, proc.stdout, proc.stderr)
    assert_quiet(block, proc.stdout, proc.stderr)


def test_the_streaming_example_is_quiet_on_its_own(builtin, tmp_path):
    """Run alone, as a reader tries it (no earlier block has started Ray), api.md's streaming example printed
    44 lines of Ray's own before its 3: it starts Ray through raystudy's quiet helper first."""
    block = next(b for b in PYTHON if "open_split(" in b.code)
    store = tmp_path / "results" / "demo" / "data"
    store.mkdir(parents=True)
    (store / "shift-color").symlink_to(builtin["stores"]["shift-color"], target_is_directory=True)
    proc = _run([sys.executable, "-c", block.code], tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_quiet(block, proc.stdout, proc.stderr)
    assert len(printed(proc.stdout).splitlines()) == 3, proc.stdout
