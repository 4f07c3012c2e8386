"""Every command line that README.md and docs/ show is accepted by today's command-line interfaces, so the
documentation cannot drift from the code: `dsmt VERB ...` and `python launch/train.py ...` parse with dsmt's
parser, the deepspeed launcher's options with DeepSpeed's, and a script's options are among those its
`--help` lists."""

import re
import shlex
import subprocess
from functools import cache

import pytest

from dsmt.cli import build_parser
from tests.conftest import PYTHON, REPO, run_env

DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RUNS_DSMT = re.compile(r"^(dsmt |python3? (-m dsmt\.cli|launch/|benchmarks/)|deepspeed |bash benchmarks/)")


def commands(path) -> list[str]:
    """Commands in the document's indented code blocks (continuation lines joined, `&&` chains split) and in
    inline code that runs a repository script."""
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    found = [line.strip() for line in text.splitlines() if line.startswith("    ")]
    found += [" ".join(span.split()) for span in re.findall(r"`(python (?:launch|benchmarks)/[^`]+)`", text)]
    parts = [part.strip() for line in found for part in line.split("&&")]
    return [part for part in parts if RUNS_DSMT.match(part)]


def arguments(command: str) -> list[str]:
    """The words of ``command`` without comments, redirections and command substitutions."""
    command = re.sub(r"\$\([^)]*\)", "PATH", command.split(" #")[0])
    words, kept = shlex.split(command), []
    skip = False
    for word in words:
        if skip:
            skip = False
        elif word in ("<", ">", "2>", "|"):
            skip = True
        else:
            kept.append(word)
    return kept


@cache
def script_options(script: str) -> set[str]:
    done = subprocess.run([PYTHON, script, "--help"], cwd=REPO, env=run_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, f"{script} --help failed: {done.stderr[-1000:]}"
    return set(re.findall(r"--[\w-]+", done.stdout))


def check(words: list[str]) -> None:
    if words[0] == "dsmt":
        build_parser().parse_args(words[1:])
    elif words[:3] == ["python", "-m", "dsmt.cli"]:
        build_parser().parse_args(words[3:])
    elif words[0] == "deepspeed":
        from deepspeed.launcher.runner import parse_args

        script = next(i for i, w in enumerate(words) if w.endswith(".py"))
        parse_args(words[1:script] + [words[script]])
        check(["python", *words[script:]])
    elif words[0] in ("python", "python3") and words[1] == "launch/train.py":
        build_parser().parse_args(["train", *words[2:]])
    else:  # python benchmarks/X.py, python launch/multi30k.py, bash benchmarks/gpu_check.sh
        script = words[1].replace("gpu_check.sh", "gpu_check.py")
        unknown = {w.split("=")[0] for w in words[2:] if w.startswith("--")} - script_options(script)
        assert not unknown, f"{script} has no option {sorted(unknown)}"


ALL = [(path.name, command) for path in DOCUMENTS for command in commands(path)]


def test_the_documents_show_commands():
    assert sum(name == "README.md" for name, _ in ALL) >= 15 and len({name for name, _ in ALL}) >= 3


@pytest.mark.parametrize("document, command", ALL, ids=[f"{n}:{c[:60]}" for n, c in ALL])
def test_documented_command_parses(document, command):
    check(arguments(command))
