"""Write docs.jsonl, the demo corpus: the Python Language Reference as shipped inside every CPython
(pydoc_data.topics, the text behind `help("if")`), cut into one document per section.

Licence: Python's documentation is distributed under the PSF License Agreement (see LICENSE-PSF.txt
beside this file). Usage: python tools/demo_corpus/make_corpus.py [--output docs.jsonl]
"""
import argparse
import json
import os
import re
import sys
from pydoc_data.topics import topics

# A heading is a line underlined by a run of '*', '=', '-' or '~' of the same length.
HEADING = re.compile(r"^(?P<title>[^\n]+)\n(?P<rule>[*=\-~])(?P=rule)+\n", re.MULTILINE)
MIN_DOC_CHARS = 400  # sections shorter than this are folded into the following one


def sections(text):
    starts = [m.start() for m in HEADING.finditer(text)]
    if not starts or starts[0] != 0:
        starts.insert(0, 0)
    bounds = starts + [len(text)]
    return [text[a:b].strip("\n") + "\n" for a, b in zip(bounds, bounds[1:])]


def documents():
    for topic in sorted(topics):
        pending = ""
        for section in sections(topics[topic]):
            pending += ("\n" if pending else "") + section
            if len(pending) >= MIN_DOC_CHARS:
                yield topic, pending
                pending = ""
        if pending:
            yield topic, pending


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "docs.jsonl"))
    args = parser.parse_args()
    count = 0
    with open(args.output, "w", encoding="utf-8") as f:
        for topic, text in documents():
            f.write(json.dumps({"topic": topic, "text": text}, ensure_ascii=False) + "\n")
            count += 1
    print(f"wrote {count} documents to {args.output} (from Python {sys.version.split()[0]})")


if __name__ == "__main__":
    main()
