"""The README is a door that works (issue 30, part 7).

* its flag table lists exactly the flags ``elasticrun --help`` shows, and its
  environment tables exactly the variables the code reads or sets;
* every code block is run or checked against the code, unless an HTML comment
  right above it says why it is not a command (``<!-- not runnable: ... -->``,
  ``<!-- output, not a command -->``): the quickstart script runs under
  elasticrun with the README's own command line, the launch snippet runs as a
  script, ``make`` targets must exist, ``pip install`` extras must be declared.
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from elastic import control_store, protocol
from elastic.runner import cli, horovod_flags

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
MARK = re.compile(r"<!-- (not runnable|output|not a command)\b[^>]*\S[^>]*-->\s*$")
TIMEOUT_S = 240


def blocks():
    """(language, text, marked) for each fenced block of the README."""
    out = []
    lines = README.splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        end = lines.index("```", i + 1)
        above = next((line for line in reversed(lines[:i]) if line.strip()), "")
        out.append((fence.group(1), "\n".join(lines[i + 1:end]), bool(MARK.search(above))))
        i = end + 1
    return out


def section(title):
    start = README.index(f"## {title}")
    end = README.find("\n## ", start + 1)
    return README[start:end if end != -1 else None]


def commands(text):
    """Shell commands of a block: continuations joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", text)
    return [line.split(" #")[0].strip() for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_the_readme_stays_a_door():
    assert len(README.splitlines()) < 400


# -- tables against the code ---------------------------------------------------------------
def test_the_flag_table_lists_exactly_the_flags_of_elasticrun_help():
    help_text = cli.build_parser().format_help()
    invocations = "\n".join(line for line in help_text.splitlines() if line.startswith("  -"))
    shown = set(re.findall(r"(?<![\w-])(-{1,2}[a-zA-Z][\w-]*)", invocations))
    assert shown <= set(cli.build_parser().flags)
    table = "\n".join(line for line in section("`elasticrun` flags").splitlines()
                      if line.startswith("| `"))
    listed = set(re.findall(r"(?<=[`/])(-{1,2}[a-zA-Z][\w-]*)", table))
    assert sorted(shown - listed) == [], "flags missing from the README's table"
    assert sorted(listed - shown) == [], "the README's table lists flags elasticrun lacks"
    rows = [line.split("|")[1] for line in table.splitlines()]
    assert len(rows) == len(set(rows)), "a flag has two rows"


def _env_names(text):
    return set(re.findall(r"\b((?:ELASTIC|HOROVOD)_[A-Z_]+)\b", text))


def test_the_environment_tables_list_exactly_the_variables_of_the_code():
    code = {getattr(protocol, n) for n in dir(protocol) if n.startswith("ENV_")}
    code |= {getattr(control_store, n) for n in dir(control_store) if n.startswith("ENV_")}
    code |= set(protocol.membership_env({f: 0 for f in protocol.MEMBERSHIP_FIELDS}, "h"))
    code |= set(horovod_flags.IGNORED_ENV) | {horovod_flags.FUSION_ENV,
                                              horovod_flags.START_TIMEOUT_ENV}
    documented = _env_names(section("Environment variables"))
    twins = {n for n in code if n.startswith("HOROVOD_") and n.replace("HOROVOD_", "ELASTIC_", 1)
             in code}                                   # "a HOROVOD_* twin of each"
    assert sorted(code - documented - twins) == [], "variables the README does not list"
    assert sorted(documented - code) == [], "the README lists variables the code lacks"


# -- code blocks ---------------------------------------------------------------------------------
def test_every_block_is_checked_or_marked():
    checked = {"bash", "python"}
    unmarked = [text[:60] for lang, text, marked in blocks() if not marked and lang not in checked]
    assert unmarked == [], "blocks that are neither run nor marked as not runnable"


def _makefile_targets():
    return set(re.findall(r"^([a-z][\w-]*):", (REPO / "Makefile").read_text(), re.M))


def _extras():
    text = (REPO / "setup.py").read_text()
    return set(re.findall(r'"(\w+)":\s*\[', text.split("extras_require", 1)[1].split(")")[0]))


def shell_commands():
    return [c for lang, text, marked in blocks() if lang == "bash" and not marked
            for c in commands(text)]


def test_make_and_pip_commands_match_the_makefile_and_setup_py():
    for command in shell_commands():
        words = shlex.split(command)
        if words[0] == "make":
            assert words[1] in _makefile_targets(), command
        elif words[0] == "pip":
            extras = re.match(r"\.\[([\w,]+)\]$", words[-1])
            assert words[1:3] == ["install", "-e"] and extras, command
            assert set(extras.group(1).split(",")) <= _extras(), command
        else:
            assert words[0] == "elasticrun", f"a README command no test checks: {command}"


def _run(argv, cwd):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


def _as_argv(command):
    """A README command line with elasticrun and python as this interpreter runs them."""
    words = shlex.split(command)
    argv = [sys.executable, "-m", "elastic.runner"] if words[0] == "elasticrun" else [words[0]]
    return argv + [sys.executable if w == "python" else w for w in words[1:]]


@pytest.mark.slow
def test_the_quickstart_runs_with_the_readmes_own_commands(tmp_path):
    scripts = [text for lang, text, marked in blocks()
               if lang == "python" and not marked and "@elastic.run\ndef" in text]
    assert len(scripts) == 1
    (tmp_path / "train.py").write_text(scripts[0] + "\n")
    ran = 0
    for command in shell_commands():
        if command.startswith("elasticrun") and command.endswith("python train.py"):
            run = _run(_as_argv(command), tmp_path)
            assert run.returncode == 0, run.stderr[-3000:]
            if "--dry-run" in command:
                assert "first round: 4 workers" in run.stdout, run.stdout
            else:
                assert "trained 12 steps on 2 workers" in run.stdout, run.stdout
            ran += 1
        elif command.startswith("elasticrun"):
            run = _run(_as_argv(command), tmp_path)
            assert run.returncode == 0, (command, run.stderr)
    assert ran == 2


@pytest.mark.slow
def test_the_launch_snippet_runs(tmp_path):
    snippet = next(text for lang, text, marked in blocks()
                   if lang == "python" and not marked and "elastic.launch(" in text)
    (tmp_path / "launch_it.py").write_text(snippet + "\n")
    run = _run([sys.executable, "launch_it.py"], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    expected = re.search(r"print\(results\)\s+# (.+)$", snippet, re.M).group(1)
    assert run.stdout.strip().splitlines()[-1] == expected


def test_the_demo_script_scales_the_lr_with_lrscaler_not_by_hand():
    """The README says not to scale group["lr"] by hand; its demo does not either."""
    import ast
    tree = ast.parse((REPO / "examples" / "train_mlp.py").read_text())
    by_hand = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Assign)
               for target in node.targets if isinstance(target, ast.Subscript)
               and isinstance(target.slice, ast.Constant) and target.slice.value == "lr"]
    assert by_hand == []
    assert any(isinstance(node, ast.Attribute) and node.attr == "LRScaler"
               for node in ast.walk(tree))
