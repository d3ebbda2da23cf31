"""Generate the bundled instruction sample: short, checkable skills with one exact answer each.

    python recipes/data/make_skills.py          # rewrites skills_train.jsonl and skills_test.jsonl

Each line is a TRL prompt–completion conversation plus the skill name and the exact answer:
{"prompt": [{"role": "user", ...}], "completion": [{"role": "assistant", ...}], "skill": ..., "answer": ...}
The test items never appear in the training file (checked below).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).parent

WORDS = [
    "apple", "river", "garden", "pencil", "window", "orange", "silver", "market", "planet", "forest",
    "bridge", "candle", "doctor", "engine", "flower", "guitar", "helmet", "island", "jacket", "kitten",
    "ladder", "mirror", "needle", "ocean", "pillow", "rabbit", "saddle", "ticket", "violin", "wallet",
    "anchor", "basket", "castle", "dragon", "feather", "harbor", "jungle", "lemon", "meadow", "nickel",
    "parrot", "rocket", "shadow", "tomato", "valley", "winter", "yellow", "zipper", "butter", "circle",
]  # fmt: skip
ANTONYMS = [
    ("hot", "cold"), ("big", "small"), ("fast", "slow"), ("up", "down"), ("happy", "sad"), ("open", "closed"),
    ("light", "dark"), ("early", "late"), ("full", "empty"), ("strong", "weak"), ("high", "low"), ("old", "young"),
    ("hard", "soft"), ("wet", "dry"), ("rich", "poor"), ("thick", "thin"), ("loud", "quiet"), ("clean", "dirty"),
    ("long", "short"), ("true", "false"), ("first", "last"), ("inside", "outside"), ("win", "lose"), ("push", "pull"),
]  # fmt: skip
CAPITALS = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Japan", "Tokyo"),
    ("Egypt", "Cairo"), ("Canada", "Ottawa"), ("Russia", "Moscow"), ("Greece", "Athens"), ("Norway", "Oslo"),
    ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Cuba", "Havana"), ("Ireland", "Dublin"), ("Poland", "Warsaw"),
    ("Austria", "Vienna"), ("Portugal", "Lisbon"), ("Sweden", "Stockholm"), ("Finland", "Helsinki"),
    ("Thailand", "Bangkok"), ("China", "Beijing"), ("India", "New Delhi"), ("Chile", "Santiago"), ("Iran", "Tehran"),
]  # fmt: skip
COLORS = ["red", "blue", "green", "black", "white", "pink", "brown", "gray"]


def addition(rng):
    a, b = rng.randint(10, 49), rng.randint(10, 49)
    return f"What is {a} + {b}? Answer with the number only.", str(a + b)


def uppercase(rng):
    w = rng.choice(WORDS)
    return f"Write the word '{w}' in capital letters. Answer with the word only.", w.upper()


def antonym(rng):
    a, b = rng.choice(ANTONYMS)
    if rng.random() < 0.5:
        a, b = b, a
    return f"What is the opposite of '{a}'? Answer with one word.", b


def successor(rng):
    n = rng.randint(11, 998)
    return f"Which number comes right after {n}? Answer with the number only.", str(n + 1)


def capital(rng):
    country, city = rng.choice(CAPITALS)
    return f"What is the capital of {country}? Answer with the city only.", city


def count_words(rng):
    k = rng.randint(2, 6)
    items = " ".join(rng.choice(COLORS) for _ in range(k))
    return f"How many words are in '{items}'? Answer with the number only.", str(k)


def first_letter(rng):
    w = rng.choice(WORDS)
    return f"What is the first letter of the word '{w}'? Answer with the letter only.", w[0]


def alphabetical(rng):
    a, b = rng.sample(WORDS, 2)
    return f"Which word comes first in alphabetical order: '{a}' or '{b}'? Answer with the word only.", min(a, b)


SKILLS = {f.__name__: f for f in (addition, uppercase, antonym, successor, capital, count_words, first_letter, alphabetical)}


def example(skill: str, prompt: str, answer: str) -> dict:
    return {
        "prompt": [{"role": "user", "content": prompt}],
        "completion": [{"role": "assistant", "content": answer}],
        "skill": skill,
        "answer": answer,
    }


def generate(per_skill_train: int = 50, per_skill_test: int = 10, seed: int = 2024) -> tuple[list, list]:
    rng = random.Random(seed)
    train, test, seen = [], [], set()
    for skill, make in SKILLS.items():
        for split, n in ((test, per_skill_test), (train, per_skill_train)):
            made, attempts = 0, 0
            while made < n and attempts < 10_000:
                attempts += 1
                prompt, answer = make(rng)
                if prompt in seen:
                    continue
                seen.add(prompt)
                split.append(example(skill, prompt, answer))
                made += 1
    rng.shuffle(train)
    return train, test


def write(rows: list, path: Path) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    train, test = generate()
    assert not {r["prompt"][0]["content"] for r in train} & {r["prompt"][0]["content"] for r in test}
    write(train, HERE / "skills_train.jsonl")
    write(test, HERE / "skills_test.jsonl")
    print(f"{len(train)} training and {len(test)} held-out examples over {len(SKILLS)} skills")
