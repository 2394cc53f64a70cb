#!/usr/bin/env python
"""Write the demo corpus: configs/sample_prompts.jsonl (warmup, 200 prompts) and
configs/sample_replay.jsonl (replay, 24 requests). Prompts are a handful of shared
system prompts and documents followed by questions, so most of their tokens are shared
prefixes, as in a serving fleet's traffic. Deterministic: the files are shipped, this
script only says how they were made.

    .venv/bin/python tools/make_sample_prompts.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SYSTEMS = [
    "You are a careful assistant for a logistics company. Answer from the document only, "
    "cite the section you used, and say plainly when the document does not say.",
    "You are a support agent for a cloud storage product. Be brief, friendly and exact; "
    "give commands in code blocks and never guess a version number.",
    "You are a tutor for first-year physics students. Explain step by step, check units at "
    "every step, and end with a one-line summary of the idea used.",
    "You are a legal research assistant. Quote the clause you rely on, separate facts from "
    "interpretation, and flag anything that needs a qualified lawyer.",
]
TOPICS = ["shipping", "storage", "mechanics", "contracts"]
WORDS = {
    "shipping": [
        "pallet",
        "carrier",
        "customs",
        "invoice",
        "freight",
        "depot",
        "route",
        "manifest",
        "tariff",
        "warehouse",
        "container",
        "transit",
    ],
    "storage": [
        "bucket",
        "replica",
        "snapshot",
        "quota",
        "region",
        "object",
        "lifecycle",
        "encryption",
        "bandwidth",
        "retention",
        "volume",
    ],
    "mechanics": [
        "force",
        "mass",
        "velocity",
        "momentum",
        "energy",
        "friction",
        "torque",
        "acceleration",
        "spring",
        "pendulum",
        "collision",
    ],
    "contracts": [
        "clause",
        "party",
        "liability",
        "term",
        "notice",
        "breach",
        "remedy",
        "warranty",
        "indemnity",
        "jurisdiction",
        "assignment",
    ],
}
QUESTIONS = [
    "What does section {n} require?",
    "Summarize section {n} in two sentences.",
    "Which terms in section {n} matter most, and why?",
    "Is there an exception in section {n}?",
    "How would you explain section {n} to a new colleague?",
    "What is missing from section {n}?",
]


def document(topic: str, rng: random.Random) -> str:
    w = WORDS[topic]
    sections = []
    for n in range(1, 5):
        sentences = []
        for _ in range(4):
            picks = rng.sample(w, 6)
            sentences.append(
                f"The {picks[0]} and the {picks[1]} set the {picks[2]} for each {picks[3]}, "
                f"unless the {picks[4]} changes the {picks[5]}."
            )
        sections.append(f"Section {n}. " + " ".join(sentences))
    return f"Document: {topic} handbook.\n" + "\n".join(sections)


def main() -> None:
    rng = random.Random(0)
    docs = {t: document(t, rng) for t in TOPICS}
    out = Path(__file__).resolve().parent.parent / "configs"

    def prompt(i: int, r: random.Random) -> str:
        s = i % len(SYSTEMS)
        q = r.choice(QUESTIONS).format(n=r.randint(1, 4))
        if r.random() < 0.25:  # no document: the system prompt alone is shared
            return f"{SYSTEMS[s]}\n\nQuestion: {q} (ticket {r.randint(1000, 9999)})"
        return (
            f"{SYSTEMS[s]}\n\n{docs[TOPICS[s]]}\n\nQuestion: {q} (ticket {r.randint(1000, 9999)})"
        )

    with open(out / "sample_prompts.jsonl", "w") as f:
        for i in range(200):
            f.write(json.dumps({"text": prompt(i, rng)}) + "\n")
    rng2 = random.Random(1)
    with open(out / "sample_replay.jsonl", "w") as f:
        for i in range(24):
            f.write(json.dumps({"text": prompt(i, rng2)}) + "\n")
    print(f"wrote {out / 'sample_prompts.jsonl'} (200) and {out / 'sample_replay.jsonl'} (24)")


if __name__ == "__main__":
    main()
