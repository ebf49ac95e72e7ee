"""The demo's output is quoted from one place, and the quote is a real run's.

`make demo` writes what it prints after training to out/demo/summary.txt
(examples/demo.sh); examples/demo_summary.txt is one run's. README's Demo section
quotes its end verbatim, from the last progress line on (so no evaluation line after it
is left out), and no other document repeats those numbers: examples/README.md links to
README instead. Negative controls: an excerpt missing a line, or with a number changed,
is reported; a document repeating a number is found.
"""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
RECORD = REPO / "examples" / "demo_summary.txt"
DEMO = REPO / "examples" / "demo.sh"
NUMBER = re.compile(r"\d\.\d+E[+-]\d\d")


def demo_excerpt(readme: str) -> list[str]:
    """The code block of README's Demo section that ends with the demo's verdict."""
    section = readme.split("\n## Demo\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```\n(.*?)```", section, re.S)
    quoted = [b.splitlines() for b in blocks if "demo learned:" in b]
    assert len(quoted) == 1, "README's Demo section should quote the demo's end once"
    return quoted[0]


def excerpt_problems(excerpt: list[str], record: list[str]) -> list[str]:
    """How an excerpt differs from the record's end, from its last progress line on."""
    last = max(i for i, line in enumerate(record) if re.match(r"iteration +\d+/", line))
    end = record[last:]
    if excerpt == end:
        return []
    return [f"README: {a!r}\nrecord: {b!r}" for a, b in zip(excerpt + [""] * len(end), end + [""] * len(excerpt))
            if a != b]


def test_the_record_has_the_shape_the_demo_writes():
    record = RECORD.read_text().splitlines()
    assert record[-1].startswith("demo learned: final validation loss ")
    assert all(re.match(r"(iteration +\d+/ +\d+ \| | validation loss at iteration \d+)", line) for line in record[:-1])
    final = float(NUMBER.findall([x for x in record if "validation loss at" in x][-1])[0])
    assert f"final validation loss {final:.3f} " in record[-1]  # the verdict reads the last evaluation


def test_readme_quotes_the_records_end_verbatim():
    record = RECORD.read_text().splitlines()
    assert excerpt_problems(demo_excerpt(README.read_text()), record) == []
    # negative controls: a line left out, a number changed
    excerpt = demo_excerpt(README.read_text())
    assert excerpt_problems(excerpt[:1] + excerpt[2:], record)
    assert excerpt_problems([excerpt[0].replace(NUMBER.findall(excerpt[0])[0], "4.895159E+00")] + excerpt[1:], record)


def test_no_other_document_repeats_the_demos_numbers():
    readme = README.read_text()
    numbers = set(NUMBER.findall("\n".join(demo_excerpt(readme))))
    assert numbers
    outside = readme.replace("\n".join(demo_excerpt(readme)), "")
    documents = {"README.md (outside the excerpt)": outside}
    for path in [*sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "examples").rglob("*.md"))]:
        documents[str(path.relative_to(REPO))] = path.read_text()
    repeated = {name: sorted(numbers & set(NUMBER.findall(text))) for name, text in documents.items()}
    assert {name: found for name, found in repeated.items() if found} == {}
    assert "](../README.md#demo)" in (REPO / "examples" / "README.md").read_text()
    # negative control: a document that repeats one is found
    assert numbers & set(NUMBER.findall(f"ends at {sorted(numbers)[0]}"))


def test_the_demo_keeps_what_it_prints_after_training():
    script = DEMO.read_text()
    assert "\"$OUT/train.log\" | tee \"$OUT/summary.txt\"" in script  # the progress lines, afresh each run
    assert "<<'EOF' | tee -a \"$OUT/summary.txt\"" in script  # then the verdict
