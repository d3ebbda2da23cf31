"""Generate the bundled instruction samples: short, checkable skills with one exact answer each.

    python recipes/data/make_skills.py          # rewrites skills_*.jsonl and skills2_*.jsonl

Two sets with different skills: ``skills`` (the main job's task) and ``skills2`` (a second task of the
quality benchmark, ``benchmarks/quality.py``).

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

# ------------------------------------------------------------------ the second set (skills2)
def subtraction(rng):
    a, b = rng.randint(30, 99), rng.randint(10, 29)
    return f"What is {a} - {b}? Answer with the number only.", str(a - b)


def predecessor(rng):
    n = rng.randint(12, 999)
    return f"Which number comes right before {n}? Answer with the number only.", str(n - 1)


def last_letter(rng):
    w = rng.choice(WORDS)
    return f"What is the last letter of the word '{w}'? Answer with the letter only.", w[-1]


def double(rng):
    n = rng.randint(6, 499)
    return f"What is double {n}? Answer with the number only.", str(2 * n)


def larger(rng):
    a, b = rng.sample(range(100, 1000), 2)
    return f"Which number is larger: {a} or {b}? Answer with the number only.", str(max(a, b))


def times_ten(rng):
    n = rng.randint(2, 999)
    return f"What is {n} times 10? Answer with the number only.", str(10 * n)


def capitalized(rng):
    w = rng.choice(WORDS)
    return f"Write the word '{w}' with a capital first letter. Answer with the word only.", w.capitalize()


def word_repeat(rng):
    w, n = rng.choice(WORDS), rng.randint(2, 3)
    return f"Write the word '{w}' {n} times, separated by spaces. Answer with the words only.", " ".join([w] * n)


SKILLS2 = {f.__name__: f for f in (subtraction, predecessor, last_letter, double, larger, times_ten, capitalized, word_repeat)}
SETS = {"skills": (SKILLS, 50, 10, 2024), "skills2": (SKILLS2, 50, 25, 2025)}  # skills, train/test items per skill, seed


def example(skill: str, prompt: str, answer: str) -> dict:
    return {
        "prompt": [{"role": "user", "content": prompt}],
        "completion": [{"role": "assistant", "content": answer}],
        "skill": skill,
        "answer": answer,
    }


def draw(skills: dict, per_skill_train: int, per_skill_test: int, rng: random.Random, attempts: int = 10_000,
         complete: bool = False) -> tuple[list, list]:
    """Held-out items first, then training items, skill by skill; no prompt appears twice. A skill that runs out of
    distinct prompts within ``attempts`` draws gets fewer items, or (``complete``) raises naming it."""
    train, test, seen = [], [], set()
    for skill, make in skills.items():
        for split, n in ((test, per_skill_test), (train, per_skill_train)):
            made, tried = 0, 0
            while made < n and tried < attempts:
                tried += 1
                prompt, answer = make(rng)
                if prompt in seen:
                    continue
                seen.add(prompt)
                split.append(example(skill, prompt, answer))
                made += 1
            if complete and made < n:
                raise ValueError(f"skill {skill!r} ran out of distinct prompts after {made} of {n}")
    rng.shuffle(train)
    return train, test


def generate(per_skill_train: int = 50, per_skill_test: int = 10, seed: int = 2024, skills: dict = SKILLS) -> tuple[list, list]:
    """The skills' examples from ``seed`` (:func:`draw`); a skill with few distinct prompts (capitals) gets fewer
    training items."""
    return draw(skills, per_skill_train, per_skill_test, random.Random(seed))


def write(rows: list, path: Path) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    for name, (skills, n_train, n_test, seed) in SETS.items():
        train, test = generate(n_train, n_test, seed, skills)
        assert not {r["prompt"][0]["content"] for r in train} & {r["prompt"][0]["content"] for r in test}
        write(train, HERE / f"{name}_train.jsonl")
        write(test, HERE / f"{name}_test.jsonl")
        print(f"{name}: {len(train)} training and {len(test)} held-out examples over {len(skills)} skills")
