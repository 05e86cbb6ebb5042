"""The README's promises that a reading can check: its first lines are the two fresh-machine commands and CI runs
the second; every Usage command runs after the demo (none saves into the directory the demo's run holds); every
page and file it names exists."""
import os
import re
import shlex

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
README = open(os.path.join(ROOT, "README.md")).read()
DEMO_SAVE = "runs/tiny_cpu"  # configs/tiny_cpu.yaml's checkpoint.save


def commands(block: str) -> list[str]:
    """The commands of a bash block, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", block)
    return [ln.split("  #")[0].strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]


def test_the_first_block_is_the_demo_and_the_tests_and_ci_runs_the_tests():
    first = commands(re.search(r"```bash\n(.*?)```", README, re.S).group(1))
    assert len(first) == 2 and first[0].endswith("--config configs/tiny_cpu.yaml") and "pytest" in first[1], first
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert first[1] in ci


def test_every_usage_command_runs_after_the_demo():
    """A run after the demo either resumes the demo's directory or saves into one of its own: ``check_save_dir``
    refuses a save directory that holds another run."""
    usage = README[README.index("## Usage"):]
    runs = [c for c in commands(re.search(r"```bash\n(.*?)```", usage, re.S).group(1))
            if "pretrain_gpt.py" in c]
    assert len(runs) >= 3
    saves = []
    for c in runs:
        sets = dict(a.split("=", 1) for a in shlex.split(c) if "=" in a and not a.startswith("-"))
        if sets.get("checkpoint.load") == DEMO_SAVE:
            continue
        save = sets.get("checkpoint.save")
        assert save and save != DEMO_SAVE and save not in saves, c
        saves.append(save)


def test_every_page_and_file_the_readme_names_exists():
    named = set(re.findall(r"\]\(([^)#]+)", README))  # links
    named |= {m for m in re.findall(r"`((?:docs|configs|tools|scripts|bench)/[\w./-]+)`", README)}
    missing = [p for p in sorted(named) if not os.path.exists(os.path.join(ROOT, p))]
    assert named and not missing, missing
