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


def usage_commands(tool: str) -> list[tuple[str, str]]:
    """(the comment lines just above it, joined; the command) for every Usage command that runs ``tool``."""
    usage = README[README.index("## Usage"):]
    text = re.sub(r"\\\n\s*", " ", re.search(r"```bash\n(.*?)```", usage, re.S).group(1))
    out, comment = [], []
    for ln in text.splitlines():
        if ln.startswith("#"):
            comment.append(ln[1:].strip())
            continue
        if tool in ln:
            out.append((" ".join(comment), ln.split("  #")[0].strip()))
        comment = []
    return out


def test_the_estimator_and_rehearsal_figures_are_what_the_commands_print(capsys):
    """Each figure beside an estimate command is what that command prints: "the estimator's peak X GiB" its line
    marked ``<- peak``, "host Z GiB per GPU" its host line's. "Rehearsed R GiB, +P% from the estimator's A GiB
    allocated" and "host H GiB a rank" are the summary line of the rehearsal the comment's page shows, and A is
    still what the estimator says for that command (``allocated_peak``: live tensors, what a rehearsal counts); a
    rehearsal of older code says its date and what changed since, its figures on its page."""
    from megatron_lc.config import load_config
    from megatron_lc.estimate import estimate, load_hardware
    from megatron_lc.units import GIB
    from tools import estimate as estimate_tool

    checked = 0
    for comment, command in usage_commands("tools/estimate.py"):
        said = re.search(r"the estimator's peak ([\d.]+) GiB", comment)
        if said is None:
            continue
        argv = shlex.split(command)[2:]
        assert estimate_tool.main(argv) == 0, command
        out = capsys.readouterr().out
        assert said[1] == re.search(r" ([\d.]+) GiB  <- peak", out)[1], (command, out)
        host = re.search(r"host ([\d.]+) GiB per GPU", comment)
        assert host is None or f"({host[1]} GiB per GPU)" in out, (comment, out)
        args = estimate_tool.parse_args(argv)
        hw = load_hardware(args.hardware)
        est = estimate(load_config(args.config, args.overrides), hw, args.gpus or hw.gpus_per_node)
        rehearsed = re.search(r"rehearsed ([\d.]+) GiB, ([+-][\d.]+)% from the estimator's ([\d.]+) GiB allocated",
                              comment)
        page = open(os.path.join(ROOT, re.search(r"(docs/\w+\.md)", comment)[1])).read()
        if rehearsed is None:  # rehearsed with older code: its date and what changed since are said, its page holds it
            older = re.search(r"rehearsed (20\d\d-\d\d-\d\d) before (.+?): ([\d.]+) GiB against the estimator's "
                              r"([\d.]+) then", comment)
            assert older is not None, comment
            assert f"max peak device {older[3]} GiB (estimator {older[4]} GiB allocated" in page, comment
            checked += 1
            continue
        assert rehearsed[3] == f"{est.memory.allocated_peak / GIB:.2f}", (comment, est.memory.allocated_peak / GIB)
        assert f"max peak device {rehearsed[1]} GiB (estimator {rehearsed[3]} GiB allocated, {rehearsed[2]}%" in page
        rank_host = re.search(r"host ([\d.]+) GiB a rank", comment)
        assert rank_host is None or f"max host {rank_host[1]} GiB" in page, comment
        checked += 1
    assert checked == 3


def test_the_demo_s_parameter_count_is_the_log_s():
    from megatron_lc.config import load_config

    said = re.search(r"trains a ([\d.]+)M-parameter", README)[1]
    assert said == f"{load_config(os.path.join(ROOT, 'configs', 'tiny_cpu.yaml')).model.num_parameters() / 1e6:.2f}"


def test_the_demo_s_last_line_quoted_is_the_run_s_summary_line():
    """The README quotes the demo's last line as ``training/logger.format_summary`` writes it, for the demo's 100
    steps, its checkpoint and its metrics file."""
    took = r"(?:\d+ min \d\d s|[0-9.]+ s)"
    line = re.search(r"\n(done: .*)\n", README)[1]
    assert re.fullmatch(rf"done: steps 1-100 of 100 in {took} \(the process: {took}\) \| loss [0-9.]+ at step 1, "
                        r"[0-9.]+ at step 100, mean [0-9.]+ over steps 91-100 \| checkpoint "
                        rf"{DEMO_SAVE}/iter_0000100 \| metrics {DEMO_SAVE}/metrics.jsonl", line), line
