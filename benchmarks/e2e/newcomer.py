"""A newcomer's first ten minutes (issue 32): the README's quick start, run as a new user runs it.

A fresh `git clone` of a repository (a path or URL, at a commit) into a temp dir, a fresh venv, then
the lines of the clone's README "Quick start" section, verbatim, each in bash from the clone's root
with the venv active, under a pseudo-terminal of 120 x 40 (so progress bars, rich tables and colours
come out as on a terminal). Kept per line: the wall time, the start of each `&&`-joined command (from
bash's xtrace into a separate file, so the screen is untouched), the exit status, and the first
screen (`--screen` lines, 40) and last lines of the output as a terminal would show them at the end
(a small emulator below applies carriage returns and cursor moves, drops colours). Also kept: the
machine (CPU model, cores, RAM, load average), the fresh venv's versions and size, the exact
commands, and this machine's pip configuration (it decides where wheels come from).

A CPU-only machine needs a CPU build of torch before `pip install .`, or pip fetches the CUDA build
and its libraries (6.1 GB of venv in issue 32's run). The README says how in a line of its own
(`pip install torch --index-url .../whl/cpu`), which this script runs first; `--torch CMD` runs CMD
instead (a machine that reaches only PyPI and keeps a CPU torch on local disk: `--torch "pip install
torch==2.13.0"`), and the result says which ran. Run from the repository root:

    python benchmarks/e2e/newcomer.py                                    # this checkout's HEAD
    python benchmarks/e2e/newcomer.py --torch "pip install torch==2.13.0" --out benchmarks/results/newcomer_cpu.json
    python benchmarks/e2e/newcomer.py --source https://github.com/OWNER/REPO --commit main --keep

It takes as long as the quick start does (10+ minutes on 2 cores, most of it the test suite): run
it alone on a quiet machine, its times are what the README quotes.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import platform
import pty
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import termios
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root (see benchmarks/_meta.py)
from benchmarks._meta import REPO, RESULTS, run_meta, write_result  # noqa: E402

COLUMNS, ROWS = 120, 40
TAIL_LINES = 15
TRACE_PREFIX = "+newcomer "  # PS4 of the traced lines: the prefix, then $EPOCHREALTIME
# The venv's versions, printed by its own interpreter as JSON (None for a package it lacks).
VERSIONS_CODE = r"""
import importlib, json, platform
out = {"python": platform.python_version()}
for name in ("numpy", "torch", "lightning", "lightning_adaptiveload", "diffusers", "transformers", "rich"):
    try:
        out[name] = importlib.import_module(name).__version__
    except Exception:
        out[name] = None
try:
    import torch
    out["cuda"] = torch.version.cuda
except Exception:
    out["cuda"] = None
print(json.dumps(out))
"""


def quick_start_lines(readme: str) -> tuple[str | None, list[str]]:
    """(the CPU torch line or None, the other command lines) of the README's "## Quick start"
    section: every non-empty, non-comment line of its ```bash blocks, in order; the torch line is
    the one that runs `pip install torch`. Raises ValueError when the section or its commands are
    missing."""
    match = re.search(r"^## Quick start\n(.*?)(?=^## )", readme + "\n## ", flags=re.S | re.M)
    if match is None:
        raise ValueError("README.md has no '## Quick start' section")
    lines = [line.strip() for block in re.findall(r"^```bash\n(.*?)^```", match.group(1), flags=re.S | re.M)
             for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    torch_lines = [line for line in lines if re.match(r"pip install torch\b", line)]
    commands = [line for line in lines if line not in torch_lines]
    if not commands or len(torch_lines) > 1:
        raise ValueError(f"README.md's Quick start: expected command lines and at most one `pip install torch` "
                         f"line in its bash blocks, found {lines}")
    return (torch_lines[0] if torch_lines else None), commands


_CSI = re.compile(r"\x1b\[([0-?]*)([ -/]*)([@-~])")
_OSC = re.compile(r"\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)")


def render_terminal(text: str, columns: int = COLUMNS) -> list[str]:
    """The lines a terminal `columns` wide shows after printing `text` (all of its scroll-back):
    printable characters overwrite at the cursor and wrap at the last column; \\r, \\n, \\b, \\t and
    the cursor and erase sequences progress bars use (CSI A B C D E F G K J) move or erase; colours,
    titles and other escape sequences are dropped. Trailing blanks are removed."""
    text = _OSC.sub("", text)
    screen: list[list[str]] = [[]]
    row = col = 0
    pos = 0

    def erase_line(mode: int) -> None:
        line = screen[row]
        if mode == 0:
            del line[col:]
        elif mode == 1:
            line[:col + 1] = [" "] * min(col + 1, len(line))
        else:
            line.clear()

    while pos < len(text):
        char = text[pos]
        if char == "\x1b":
            csi = _CSI.match(text, pos)
            if csi is None:  # a two-character escape (charset, keypad mode): dropped
                pos += 2
                continue
            pos = csi.end()
            params, final = csi.group(1), csi.group(3)
            numbers = [int(p) for p in params.split(";") if p.isdigit()]
            n = numbers[0] if numbers else None
            if final in "AF":
                row = max(row - (n or 1), 0)
                col = 0 if final == "F" else col
            elif final in "BE":
                row += n or 1
                col = 0 if final == "E" else col
            elif final == "C":
                col = min(col + (n or 1), columns - 1)
            elif final == "D":
                col = max(col - (n or 1), 0)
            elif final == "G":
                col = min(max((n or 1) - 1, 0), columns - 1)
            elif final == "K":
                while row >= len(screen):
                    screen.append([])
                erase_line(n or 0)
            elif final == "J" and (n or 0) == 0:  # erase below: what a redrawn live display does
                while row >= len(screen):
                    screen.append([])
                del screen[row][col:]
                del screen[row + 1:]
            continue
        pos += 1
        if char == "\n":
            row, col = row + 1, 0  # the pty turns \n into \r\n
        elif char == "\r":
            col = 0
        elif char == "\b":
            col = max(col - 1, 0)
        elif char == "\t":
            col = min((col // 8 + 1) * 8, columns - 1)
        elif char >= " " and char != "\x7f":  # other control characters (bell, ...) show nothing
            if col >= columns:
                row, col = row + 1, 0
            while row >= len(screen):
                screen.append([])
            line = screen[row]
            line.extend(" " * (col + 1 - len(line)))
            line[col] = char
            col += 1
        while row >= len(screen):
            screen.append([])
    lines = ["".join(line).rstrip() for line in screen]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def run_in_terminal(script: str, cwd: Path, env: dict[str, str], timeout_s: float) -> tuple[int, float, str]:
    """(exit status, wall seconds, everything printed) of `bash -c script` on a pseudo-terminal of
    COLUMNS x ROWS (stdout and stderr both, as a user's terminal shows them; stdin empty). Past
    `timeout_s` its process group is killed and the status is -SIGKILL."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLUMNS, 0, 0))
    start = time.perf_counter()
    proc = subprocess.Popen(["bash", "-c", script], cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=slave,
                            stderr=slave, start_new_session=True)
    os.close(slave)
    chunks: list[bytes] = []
    try:
        while True:
            left = timeout_s - (time.perf_counter() - start)
            if left <= 0:
                os.killpg(proc.pid, signal.SIGKILL)
                break
            ready, _, _ = select.select([master], [], [], min(left, 1.0))
            if not ready:
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every holder of the terminal has closed it
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(master)
    rc = proc.wait()
    return rc, time.perf_counter() - start, b"".join(chunks).decode("utf-8", errors="replace")


def traced_script(line: str) -> str:
    """`line` verbatim, after bash settings that send the start of each command it runs (xtrace,
    stamped with $EPOCHREALTIME) to the file named by $NEWCOMER_TRACE instead of the terminal."""
    return (f'exec 9>"$NEWCOMER_TRACE"\nBASH_XTRACEFD=9\nPS4=\'{TRACE_PREFIX}$EPOCHREALTIME \'\nset -x\n'
            f"{line}\n")


def command_times(trace: str, started: float, wall_s: float) -> list[dict]:
    """[{command, start_s, wall_s}] of the commands bash traced (TRACE_PREFIX lines of `trace`):
    start from the line's start (`started`, epoch seconds), wall time until the next command's start
    or, for the last, the line's end (`wall_s` after `started`)."""
    starts = []
    for entry in trace.splitlines():
        if entry.startswith(TRACE_PREFIX):
            stamp, _, command = entry[len(TRACE_PREFIX):].partition(" ")
            starts.append((float(stamp) - started, command))
    ends = [s for s, _ in starts[1:]] + [wall_s]
    return [{"command": c, "start_s": round(s, 3), "wall_s": round(e - s, 3)} for (s, c), e in zip(starts, ends)]


def run_line(line: str, cwd: Path, env: dict[str, str], work: Path, timeout_s: float, screen: int) -> dict:
    """One quick-start line, traced and timed in the terminal (module docstring)."""
    trace = work / "trace.txt"
    started = time.time()
    rc, wall_s, output = run_in_terminal(traced_script(line), cwd, env | {"NEWCOMER_TRACE": str(trace)}, timeout_s)
    lines = render_terminal(output)
    print(f"newcomer: rc {rc} after {wall_s:.1f} s: {line}", flush=True)
    return {"command": line, "rc": rc, "wall_s": round(wall_s, 2),
            "commands": command_times(trace.read_text() if trace.exists() else "", started, wall_s),
            "output_lines": len(lines), "first_screen": lines[:screen], "last_lines": lines[-TAIL_LINES:]}


def machine() -> dict:
    """CPU model, cores this process may use and the machine has, RAM, load average, OS."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, flags=re.M)
    meminfo = Path("/proc/meminfo").read_text() if Path("/proc/meminfo").exists() else ""
    ram_kib = re.search(r"^MemTotal:\s*(\d+) kB", meminfo, flags=re.M)
    return {"cpu": model.group(1) if model else platform.processor() or platform.machine(),
            "cores_usable": len(os.sched_getaffinity(0)), "cores": os.cpu_count(),
            "ram_gib": round(int(ram_kib.group(1)) / 2**20, 1) if ram_kib else None,
            "load_average_1_5_15min": [round(v, 2) for v in os.getloadavg()], "os": platform.platform()}


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def _checked(cmd: list[str], **kwargs) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if out.returncode != 0:
        raise RuntimeError(f"newcomer: `{' '.join(cmd)}` failed ({out.returncode}): {out.stderr[-2000:]}")
    return out.stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", default=str(REPO), help="repository to clone: a path or URL (default: this checkout)")
    parser.add_argument("--commit", default="HEAD", help="what to check out in the clone (default: its HEAD)")
    parser.add_argument("--torch", default=None,
                        help="command run in the venv instead of the README's CPU torch line (e.g. "
                             "'pip install torch==2.13.0' where only PyPI and a local CPU wheel are reachable); "
                             "'none' runs neither")
    parser.add_argument("--python", default=shutil.which("python3") or sys.executable,
                        help="interpreter that makes the venv (default: python3 on PATH)")
    parser.add_argument("--screen", type=int, default=ROWS, help="lines of each output kept from its start")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds one line may run")
    parser.add_argument("--out", default=str(RESULTS / "newcomer.json"))
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (clone and venv)")
    args = parser.parse_args(argv)

    load_at_start = [round(v, 2) for v in os.getloadavg()]
    work = Path(tempfile.mkdtemp(prefix="newcomer-"))
    clone, venv = work / "repo", work / "venv"
    steps: list[dict] = []
    try:
        t0 = time.perf_counter()
        _checked(["git", "clone", "--quiet", args.source, str(clone)])
        _checked(["git", "checkout", "--quiet", args.commit], cwd=clone)
        commit = _checked(["git", "rev-parse", "HEAD"], cwd=clone).strip()
        steps.append({"command": f"git clone {args.source} && git checkout {args.commit}", "rc": 0,
                      "wall_s": round(time.perf_counter() - t0, 2)})
        t0 = time.perf_counter()
        _checked([args.python, "-m", "venv", str(venv)])
        steps.append({"command": f"{args.python} -m venv {venv.name}", "rc": 0, "wall_s": round(time.perf_counter() - t0, 2)})
        readme_torch, lines = quick_start_lines((clone / "README.md").read_text(encoding="utf-8"))
        # the environment `source venv/bin/activate` makes, without what points at another checkout
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv),
                   TERM="xterm-256color", COLUMNS=str(COLUMNS), LINES=str(ROWS))
        torch_line = readme_torch if args.torch is None else (None if args.torch == "none" else args.torch)
        if torch_line is not None:
            steps.append(run_line(torch_line, clone, env, work, args.timeout, args.screen) | {"role": "cpu torch"})
        for line in lines:
            steps.append(run_line(line, clone, env, work, args.timeout, args.screen) | {"role": "quick start"})
            if steps[-1]["rc"] != 0:  # a user stops at the first failure too
                break
        versions = json.loads(_checked([str(venv / "bin" / "python"), "-c", VERSIONS_CODE], cwd=work))
        pip_config = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "config", "list"], env=env,
                                    capture_output=True, text=True).stdout.splitlines()
        doc = {
            **run_meta("newcomer", argv, **versions),  # the fresh venv's versions, not this interpreter's
            "what": "fresh clone, fresh venv, the README's Quick start lines verbatim, in a 120x40 pseudo-terminal",
            "clone": {"source": args.source, "requested": args.commit, "commit": commit},
            "machine": machine() | {"load_average_1_5_15min_at_start": load_at_start},
            "venv": {"python": args.python, "versions": versions, "bytes_at_end": tree_bytes(venv)},
            "cpu_torch": {"readme_line": readme_torch, "ran": torch_line,
                          "note": None if torch_line == readme_torch else
                          "the README's CPU torch line was replaced by --torch (this machine's network)"},
            "pip_config": pip_config,
            "steps": steps,
            "quick_start_s": round(sum(s["wall_s"] for s in steps if s.get("role") == "quick start"), 2),
        }
        write_result(args.out, doc)
        return 0 if all(s["rc"] == 0 for s in steps) else 1
    finally:
        if args.keep:
            print(f"newcomer: kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
