"""benchmarks/e2e/newcomer.py without its long run: the README's Quick start lines as the script
reads them, the terminal emulator on hand-made progress-bar output against the screen a terminal
shows, the xtrace split of a `&&` line, and one short line run in the pseudo-terminal."""
import os

import pytest

from benchmarks.e2e import newcomer
from tests.benchmarks import REPO


def test_quick_start_lines_of_this_readme_and_of_made_up_ones():
    torch_line, lines = newcomer.quick_start_lines((REPO / "README.md").read_text(encoding="utf-8"))
    assert torch_line.startswith("pip install torch") and "whl/cpu" in torch_line
    assert lines[0].startswith("pip install . && adaptiveload fit --config examples/configs/demo.yaml")
    assert lines[1].startswith('pip install ".[dev,diffusers,encode]" && python -m pytest')
    assert len(lines) == 2
    readme = ("# x\n## Quick start\ntext\n```bash\n# a comment\nmake a\n\nmake b   # why\n```\n```python\nno\n```\n"
              "```bash\npip install torch==1.0\n```\n## Next\n```bash\nnot this\n```\n")
    assert newcomer.quick_start_lines(readme) == ("pip install torch==1.0", ["make a", "make b   # why"])
    assert newcomer.quick_start_lines(readme.replace("pip install torch==1.0", "make c")) == (
        None, ["make a", "make b   # why", "make c"])
    with pytest.raises(ValueError, match="no '## Quick start'"):
        newcomer.quick_start_lines("# x\n## Install\n")
    with pytest.raises(ValueError, match="expected command lines"):
        newcomer.quick_start_lines("## Quick start\n```bash\npip install torch\n```\n")


@pytest.mark.parametrize("printed, screen", [
    # tqdm: one line redrawn after carriage returns
    ("start\r\nbar   0%\rbar  50%\rbar 100%\r\nend\r\n", ["start", "bar 100%", "end"]),
    # rich live display: two lines erased and redrawn from the top (erase line, cursor up)
    ("x\r\nA 1\r\nB 1\r\x1b[2K\x1b[1A\x1b[2KA 2\r\nB 2\r\n", ["x", "A 2", "B 2"]),
    # colours, a hidden cursor and a window title leave no text
    ("\x1b]0;title\x07\x1b[?25l\x1b[1;31mred\x1b[0m ok\x1b[?25h\r\n", ["red ok"]),
    # a line longer than the terminal wraps; erase to the end of the line; a shorter redraw
    ("a" * 130 + "\r\n" + "12345\r\x1b[3C\x1b[K\r\n" + "long line\rshort\r\n",
     ["a" * 120, "a" * 10, "123", "shortline"]),
    # cursor to a column, backspace, tab
    ("abcdef\x1b[3GX\bY\tZ\r\n", ["abYdef  Z"]),
])
def test_render_terminal_gives_the_screen_a_terminal_shows(printed, screen):
    assert newcomer.render_terminal(printed) == screen


def test_command_times_split_a_line_at_its_traced_commands():
    trace = ("+newcomer 100.500000 pip install .\n" "unrelated\n"
             "+newcomer 130.250000 adaptiveload fit --config examples/configs/demo.yaml\n")
    assert newcomer.command_times(trace, started=100.0, wall_s=95.0) == [
        {"command": "pip install .", "start_s": 0.5, "wall_s": 29.75},
        {"command": "adaptiveload fit --config examples/configs/demo.yaml", "start_s": 30.25, "wall_s": 64.75}]
    assert newcomer.command_times("", 0.0, 1.0) == []


def test_a_line_runs_verbatim_in_a_terminal(tmp_path):
    line = ("echo one && printf 'p 1\\rp 2\\n' && python3 -c 'import sys; print(sys.stdout.isatty(), "
            "sys.stderr.isatty())' && echo to-stderr >&2")
    env = {**os.environ, "TERM": "xterm"}
    got = newcomer.run_line(line, tmp_path, env, tmp_path, timeout_s=60, screen=3)
    assert got["rc"] == 0 and got["command"] == line
    assert got["first_screen"] == ["one", "p 2", "True True"]  # a terminal for both streams
    assert got["last_lines"][-1] == "to-stderr" and got["output_lines"] == 4
    assert [c["command"].split()[0] for c in got["commands"]] == ["echo", "printf", "python3", "echo"]
    starts = [c["start_s"] for c in got["commands"]]
    # the commands' times are rounded to 1 ms and the line's to 10 ms: their sum may exceed it by that much
    assert starts == sorted(starts)
    assert sum(c["wall_s"] for c in got["commands"]) <= got["wall_s"] + 5e-3 + 0.5e-3 * len(got["commands"])
    failed = newcomer.run_line("echo a && false && echo never", tmp_path, env, tmp_path, timeout_s=60, screen=40)
    assert failed["rc"] == 1 and failed["first_screen"] == ["a"]
