"""Generate the quality benchmark's task families: short, checkable instruction tasks with one exact answer each.

    python recipes/data/make_tasks.py              # rewrites every family's <family>_train.jsonl / <family>_test.jsonl
    python recipes/data/make_tasks.py recall       # one family

Each family is a kind of task, made of a few skills (the ``skill`` field, scored separately):

| family | kind | skills |
|---|---|---|
| sequences | sequence manipulation | reverse, sort, deduplicate, rotate |
| arithmetic | multi-digit arithmetic | add, subtract, multiply, sum of three |
| formats | format following | JSON object, JSON list, CSV row, query string |
| strings | string transforms | backwards, spell with hyphens, remove vowels, replace a letter |
| recall | knowledge recall of facts defined here | town, job of 75 invented people |
| facts | recall of a second set of facts defined here | home port, cargo of 75 invented ships |
| classify | classification with a given label set | topic (5 labels), sentiment (2 labels) |
| synlang | a synthetic language (:mod:`peft_sparse.data`) | translate into / out of it |
| retrieval | reading a list given in the prompt | value of a key, key of a value, item at a position |
| instructions | instruction following on the bundled samples | uppercase, brackets, prefix, exclamation |
| algorithmic | list and digit operations | maximum, minimum, count, digit sum |

Which family is a *dev* family (defaults may be chosen on it) and which a *test* family (only ever reported) is
recorded in one place, ``benchmarks/quality.py`` (``TASKS``). Every family is generated from its own fixed seed,
so a rerun rewrites the same files; the held-out items never appear in the training file (checked on writing).
``synlang`` needs SmolLM2-135M-Instruct's tokenizer (the project's offline asset): its language renames that
tokenizer's word tokens (:func:`peft_sparse.data.make_languages`).

Each line is a TRL prompt–completion conversation plus the skill name and the exact answer, as ``make_skills.py``
writes: {"prompt": [{"role": "user", ...}], "completion": [{"role": "assistant", ...}], "skill": ..., "answer": ...}
Answers are one line and short (a few to ~25 tokens), scored by exact match after
:func:`peft_sparse.evaluation.normalize` (which strips surrounding quotes and a final period: no answer starts or
ends with one).
"""

from __future__ import annotations

import json
import random
import string
import sys
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from make_skills import draw as _draw, example  # noqa: E402 (the bundled skills' drawing and row format)

WORDS = [
    "apple", "river", "garden", "pencil", "window", "orange", "silver", "market", "planet", "forest",
    "bridge", "candle", "doctor", "engine", "flower", "guitar", "helmet", "island", "jacket", "kitten",
    "ladder", "mirror", "needle", "ocean", "pillow", "rabbit", "saddle", "ticket", "violin", "wallet",
    "anchor", "basket", "castle", "dragon", "feather", "harbor", "jungle", "lemon", "meadow", "nickel",
    "parrot", "rocket", "shadow", "tomato", "valley", "winter", "yellow", "zipper", "butter", "circle",
    "bottle", "button", "carpet", "cotton", "desert", "dinner", "farmer", "finger", "garlic", "hammer",
    "insect", "kettle", "lizard", "magnet", "monkey", "napkin", "oyster", "pepper", "puzzle", "ribbon",
    "salmon", "spider", "sugar", "tunnel", "turtle", "velvet", "walnut", "wizard", "bucket", "cherry",
    "cloud", "crown", "eagle", "fence", "grape", "horse", "juice", "knife", "lamp", "mouse",
    "night", "paper", "queen", "robot", "sheep", "table", "tiger", "train", "water", "zebra",
    "beach", "bread", "chair", "clock", "dream", "field", "glass", "heart", "house", "light",
    "money", "music", "party", "plant", "radio", "smile", "snake", "stone", "storm", "sword",
    "acorn", "badge", "baker", "berry", "blanket", "branch", "brick", "cabin", "camel", "canal",
    "canoe", "chalk", "cloak", "coral", "cousin", "crayon", "daisy", "dolphin", "donkey", "drawer",
    "elbow", "fabric", "falcon", "ferry", "fiddle", "flute", "fossil", "frost", "ginger", "glove",
    "goose", "gravel", "hatch", "hazel", "honey", "jelly", "kayak", "label", "lantern", "lily",
    "linen", "lobster", "mango", "maple", "marble", "melon", "mitten", "moose", "motor", "muffin",
    "noodle", "olive", "onion", "otter", "panda", "peach", "pebble", "pickle", "pigeon", "pirate",
    "poem", "pony", "pumpkin", "quilt", "raven", "ruby", "sail", "scarf", "shell", "silk",
    "slipper", "spoon", "stamp", "straw", "tulip", "vessel", "wagon", "whale", "willow", "yogurt",
]  # fmt: skip
LETTERS = string.ascii_lowercase
VOWELS = set("aeiou")


def draw(skills: dict, per_skill_train: int, per_skill_test: int, rng: random.Random) -> tuple[list, list]:
    """make_skills' drawing, every item asked for or an error naming the skill (a family's builder asks for no more
    distinct prompts than it has)."""
    return _draw(skills, per_skill_train, per_skill_test, rng, attempts=20_000, complete=True)


# ------------------------------------------------------------------ sequences: sequence manipulation
def _items(rng, low: int, high: int) -> list[str]:
    """A short list of single digits or single letters (each list one kind)."""
    pool = string.digits if rng.random() < 0.5 else LETTERS
    return [rng.choice(pool) for _ in range(rng.randint(low, high))]


def seq_reverse(rng):
    xs = _items(rng, 4, 7)
    return f"Reverse the order of this list: {' '.join(xs)}. Answer with the items separated by spaces.", " ".join(reversed(xs))


def seq_sort(rng):
    xs = [rng.randint(1, 99) for _ in range(rng.randint(4, 6))]
    return (f"Sort these numbers from smallest to largest: {' '.join(map(str, xs))}. Answer with the numbers separated by spaces.",
            " ".join(map(str, sorted(xs))))  # fmt: skip


def seq_deduplicate(rng):
    while True:
        xs = [rng.choice(LETTERS[:6]) for _ in range(rng.randint(5, 8))]
        if len(set(xs)) < len(xs):
            break
    kept = list(dict.fromkeys(xs))
    return (f"Remove the repeated letters from this list, keeping the first of each: {' '.join(xs)}. "
            "Answer with the letters separated by spaces.", " ".join(kept))  # fmt: skip


def seq_rotate(rng):
    xs = _items(rng, 4, 7)
    return f"Move the first item of this list to the end: {' '.join(xs)}. Answer with the items separated by spaces.", " ".join(xs[1:] + xs[:1])


def sequences(rng):
    return draw({"reverse": seq_reverse, "sort": seq_sort, "deduplicate": seq_deduplicate, "rotate": seq_rotate}, 150, 40, rng)


# ------------------------------------------------------------------ arithmetic: multi-digit
def ar_add(rng):
    a, b = rng.randint(100, 899), rng.randint(100, 899)
    return f"What is {a} + {b}? Answer with the number only.", str(a + b)


def ar_subtract(rng):
    a = rng.randint(300, 999)
    b = rng.randint(100, a - 1)
    return f"What is {a} - {b}? Answer with the number only.", str(a - b)


def ar_multiply(rng):
    a, b = rng.randint(12, 99), rng.randint(3, 9)
    return f"What is {a} times {b}? Answer with the number only.", str(a * b)


def ar_sum3(rng):
    a, b, c = (rng.randint(10, 99) for _ in range(3))
    return f"What is {a} + {b} + {c}? Answer with the number only.", str(a + b + c)


def arithmetic(rng):
    return draw({"add": ar_add, "subtract": ar_subtract, "multiply": ar_multiply, "sum_of_three": ar_sum3}, 150, 40, rng)


# ------------------------------------------------------------------ formats: format following
KEYS = ["name", "color", "size", "city", "owner", "label", "kind", "code"]
COLORS = ["red", "blue", "green", "black", "white", "pink", "brown", "gray"]


def _value(rng):
    return rng.randint(1, 99) if rng.random() < 0.5 else rng.choice(WORDS[:60] + COLORS)


def fmt_json_object(rng):
    k1, k2 = rng.sample(KEYS, 2)
    v1, v2 = _value(rng), _value(rng)
    said = " and ".join(f"the key \"{k}\" set to {json.dumps(v)}" for k, v in ((k1, v1), (k2, v2)))
    return f"Write a JSON object with {said}, in this order. Answer with the JSON only.", json.dumps({k1: v1, k2: v2})


def fmt_json_list(rng):
    ws = rng.sample(WORDS[:80], rng.randint(2, 4))
    listed = ", ".join(ws[:-1]) + " and " + ws[-1]
    return f"Write the words {listed} as a JSON list, in this order. Answer with the JSON only.", json.dumps(ws)


def fmt_csv_row(rng):
    fields = [rng.choice(WORDS[:60]), str(rng.randint(1, 99)), rng.choice(COLORS)]
    rng.shuffle(fields)
    listed = ", ".join(fields[:-1]) + " and " + fields[-1]
    return f"Write the fields {listed} as one CSV row, in this order. Answer with the row only.", ",".join(fields)


def fmt_query_string(rng):
    k1, k2 = rng.sample(KEYS, 2)
    v1, v2 = str(_value(rng)), str(_value(rng))
    return (f"Write {k1} = {v1} and {k2} = {v2} as a URL query string (key=value pairs joined by &), in this order. "
            "Answer with the query string only.", f"{k1}={v1}&{k2}={v2}")  # fmt: skip


def formats(rng):
    return draw({"json_object": fmt_json_object, "json_list": fmt_json_list, "csv_row": fmt_csv_row, "query_string": fmt_query_string},
                150, 40, rng)  # fmt: skip


# ------------------------------------------------------------------ strings: string transforms
def _short_word(rng):
    return rng.choice([w for w in WORDS if 4 <= len(w) <= 6])


def st_backwards(rng):
    w = _short_word(rng)
    return f"Write the word '{w}' backwards. Answer with the letters only.", w[::-1]


def st_spell(rng):
    w = _short_word(rng)
    return f"Spell the word '{w}' with a hyphen between the letters. Answer with the spelling only.", "-".join(w)


def st_remove_vowels(rng):
    w = _short_word(rng)
    return f"Remove every vowel from the word '{w}'. Answer with the remaining letters only.", "".join(c for c in w if c not in VOWELS)


def st_replace(rng):
    w = rng.choice(WORDS)
    old = rng.choice(sorted(set(w)))
    new = rng.choice([c for c in "xzqkv" if c not in w])
    return f"Replace every '{old}' in the word '{w}' with '{new}'. Answer with the new word only.", w.replace(old, new)


def strings(rng):
    skills = {"backwards": st_backwards, "spell": st_spell, "remove_vowels": st_remove_vowels, "replace": st_replace}
    return draw(skills, 150, 40, rng)


# ------------------------------------------------------------------ recall: facts defined here
SYLLABLES = ["ka", "lo", "mi", "ren", "to", "va", "dor", "el", "sa", "bru", "nim", "pe", "quo", "zan", "fi", "gal"]
TOWNS = ["Orvale", "Brimsey", "Kettlemoor", "Dunhollow", "Marrowick", "Pellingford", "Quarnby", "Ashcombe", "Tiverly", "Wendmarch"]
JOBS = ["baker", "pilot", "tailor", "farmer", "painter", "nurse", "sailor", "judge", "miner", "potter"]
RECALL_TEMPLATES = {
    "town": ["In which town does {p} live? Answer with the town only.", "Where does {p} live? Answer with the town only.",
             "Name the home town of {p}. Answer with the town only.", "{p} lives in which town? Answer with the town only."],
    "job": ["What is the job of {p}? Answer with one word.", "What does {p} work as? Answer with one word.",
            "Name the occupation of {p}. Answer with one word.", "{p} works as what? Answer with one word."],
}  # fmt: skip


def _person(rng) -> str:
    first = "".join(rng.choice(SYLLABLES) for _ in range(2)).capitalize()
    last = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()
    return f"{first} {last}"


def recall(rng):
    """75 invented people, each with a town and a job. Every fact is asked in three of its four phrasings in the
    training file and in the fourth in the held-out file: a held-out item asks a fact the training taught, in a
    phrasing the training used for other facts."""
    return _facts_about(rng, _person, {"town": TOWNS, "job": JOBS}, RECALL_TEMPLATES)


def _facts_about(rng, invent, answers: dict, templates: dict, count: int = 75) -> tuple[list, list]:
    """``count`` distinct names from ``invent(rng)``, each given one answer per relation (``answers``: relation → its
    choices) and asked in every phrasing of ``templates[relation]`` (``{p}``: the name), one phrasing held out."""
    names: list[str] = []
    while len(names) < count:
        name = invent(rng)
        if name not in names:
            names.append(name)
    train, test = [], []
    for name in names:
        for relation, answer in {relation: rng.choice(choices) for relation, choices in answers.items()}.items():
            phrasings = templates[relation]
            held_out = rng.randrange(len(phrasings))
            for i, template in enumerate(phrasings):
                (test if i == held_out else train).append(example(relation, template.format(p=name), answer))
    rng.shuffle(train)
    return train, test


# ------------------------------------------------------------------ facts: a second set, of other names and relations
SHIP_SYLLABLES = ["bar", "cel", "dun", "esk", "hol", "ith", "jor", "kel", "mar", "nor", "osk", "ryn", "sul", "tor", "ulf", "wyn"]
PORTS = ["Saltreach", "Gullmouth", "Fennport", "Crag Harbour", "Seaholme", "Tidewick", "Narrowgate", "Brinestead", "Cold Quay", "Lowmere"]
CARGOES = ["timber", "wool", "salt", "copper", "grain", "tea", "coal", "wine", "spices", "marble"]
FACT_TEMPLATES = {
    "port": ["What is the home port of the ship {p}? Answer with the port only.", "From which port does the ship {p} sail? Answer with the port only.",
             "Name the port the ship {p} belongs to. Answer with the port only.", "The ship {p} is registered in which port? Answer with the port only."],
    "cargo": ["What cargo does the ship {p} carry? Answer with one word.", "Which goods are loaded on the ship {p}? Answer with one word.",
              "Name the cargo of the ship {p}. Answer with one word.", "The ship {p} carries what? Answer with one word."],
}  # fmt: skip


def facts(rng):
    """75 invented ships, each with a home port and a cargo, asked as :func:`recall` asks its people (three phrasings
    of each fact in the training file, the fourth held out): the same kind of task over other names and relations."""
    return _facts_about(rng, _ship, {"port": PORTS, "cargo": CARGOES}, FACT_TEMPLATES)


def _ship(rng) -> str:
    return "".join(rng.choice(SHIP_SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()


# ------------------------------------------------------------------ classify: a given label set
TOPICS = {
    "sports": (["The striker", "Our goalkeeper", "The coach", "The home team", "The young sprinter", "The captain", "The referee",
                "The tennis player", "The cyclist", "The visiting side"],
               ["scored twice in the final", "won the match in extra time", "trained hard before the race", "broke the league record",
                "lost the semi-final on penalties", "signed a new contract with the club", "missed the free kick",
                "celebrated the championship", "was injured during the warm-up", "finished the marathon in third place"]),
    "food": (["The chef", "My grandmother", "The bakery", "Our waiter", "The new restaurant", "The cook", "The pastry shop",
              "The food truck", "My uncle", "The street vendor"],
             ["baked fresh bread with garlic", "served a spicy tomato soup", "fried the onions in butter", "made pancakes with honey",
              "grilled the salmon with lemon", "roasted the chicken with herbs", "prepared a salad with olives",
              "boiled the pasta for ten minutes", "sold warm chocolate cookies", "seasoned the rice with pepper"]),
    "weather": (["The forecast", "This morning", "The afternoon", "Last night", "The storm", "The weekend", "Tomorrow",
                 "The north wind", "The spring sky", "The coastal fog"],
                ["brought heavy rain and thunder", "turned cold with strong wind", "stayed sunny and warm all day",
                 "left the roads covered in snow", "promised showers in the evening", "was humid and cloudy",
                 "dropped below freezing", "cleared up after the drizzle", "brought hail over the hills", "felt dry and hot"]),
    "music": (["The band", "The orchestra", "The singer", "The pianist", "The choir", "The drummer", "The violinist",
               "The rapper", "The jazz trio", "The guitarist"],
              ["released a new album", "played the symphony in a minor key", "sang the chorus twice", "tuned the strings before the concert",
               "recorded a song in the studio", "performed the ballad live", "rehearsed the melody all night",
               "wrote lyrics for the single", "kept the rhythm steady", "toured with the record"]),
    "travel": (["The tourists", "My sister", "The backpacker", "Our family", "The pilot", "The travel agent", "The passengers",
                "The hikers", "My neighbour", "The guide"],
               ["booked a flight to the coast", "packed a suitcase for the trip", "missed the train to the capital",
                "checked into a hotel by the harbor", "crossed the border at dawn", "rented a car at the airport",
                "visited the old castle on holiday", "changed money before the journey", "boarded the ferry to the island",
                "followed the map through the mountains"]),
}  # fmt: skip
PRODUCTS = ["phone", "jacket", "lamp", "blender", "backpack", "chair", "kettle", "laptop", "umbrella", "camera", "mattress",
            "bicycle", "printer", "speaker", "watch"]  # fmt: skip
SENTIMENT = {
    "positive": ["excellent", "reliable", "comfortable", "beautiful", "sturdy", "delightful", "fantastic", "well made", "quiet", "elegant"],
    "negative": ["broken", "flimsy", "noisy", "disappointing", "useless", "uncomfortable", "cheap looking", "slow", "fragile", "awful"],
}  # fmt: skip


def cl_topic(rng):
    topic = rng.choice(sorted(TOPICS))
    subjects, predicates = TOPICS[topic]
    sentence = f"{rng.choice(subjects)} {rng.choice(predicates)}."
    return (f"What is the topic of this sentence: '{sentence}' Choose one of: sports, food, weather, music, travel. "
            "Answer with the label only.", topic)  # fmt: skip


def cl_sentiment(rng):
    label = rng.choice(sorted(SENTIMENT))
    a, b = rng.sample(SENTIMENT[label], 2)
    review = f"The {rng.choice(PRODUCTS)} I bought is {a} and {b}."
    return f"Is this review positive or negative: '{review}' Answer with positive or negative.", label


def classify(rng):
    return draw({"topic": cl_topic, "sentiment": cl_sentiment}, 300, 75, rng)


# ------------------------------------------------------------------ synlang: a synthetic language (peft_sparse.data)
SYNLANG_WORDS = [
    "apple", "river", "orange", "market", "doctor", "flower", "guitar", "helmet", "jacket", "needle", "ocean", "rabbit",
    "ticket", "violin", "wallet", "green", "white", "house", "tree", "bird", "cat", "dog", "king", "horse", "small",
    "happy", "water", "bread", "night", "music", "cloud", "garden", "window", "silver", "forest", "bridge", "stone",
    "red", "blue", "fish", "lamp", "table", "chair", "road", "book", "door", "sun", "moon", "milk", "snow", "old", "new",
]  # fmt: skip


def synthetic_language(tokenizer, seed: int = 0, size: int = 32):
    """(the language, its vocabulary: (English word, its word in the language) pairs): ``make_languages``'s language
    "xa" over ``tokenizer``, restricted to ``size`` words of :data:`SYNLANG_WORDS` that are one token and that the
    language renames."""
    from peft_sparse.data import make_languages

    language = make_languages(tokenizer, ["xa"], fraction=0.5, seed=seed)["xa"]
    renamed = set(language.words.tolist())
    vocabulary = []
    for word in SYNLANG_WORDS:
        ids = tokenizer(" " + word, add_special_tokens=False)["input_ids"]
        if len(ids) == 1 and ids[0] in renamed:
            translated = tokenizer.decode(language.translate(ids)).strip()
            if translated.isalpha() and translated.lower() not in {w for w, _ in vocabulary}:
                vocabulary.append((word, translated))
        if len(vocabulary) == size:
            return language, vocabulary
    raise ValueError(f"only {len(vocabulary)} of the words are renamed single tokens; the family needs {size}")


def synlang(rng, tokenizer=None):
    """Translation into and out of "Xa", a language of :func:`peft_sparse.data.make_languages` (a fixed renaming of
    SmolLM2's word tokens): phrases of 1–3 words from a 32-word vocabulary, each word token replaced by its Xa token.
    Every word occurs in many training phrases; the held-out phrases are combinations no training item holds."""
    if tokenizer is None:
        tokenizer = smollm2_tokenizer()
    language, vocabulary = synthetic_language(tokenizer)

    def render(pairs) -> tuple[str, str]:
        english = " ".join(w for w, _ in pairs)
        ids = tokenizer(" " + english, add_special_tokens=False)["input_ids"]
        return english, tokenizer.decode(language.translate(ids)).strip()  # (the language's own rendering)

    def phrases(n: int, exclude: set) -> list:
        out: list = []
        while len(out) < n:
            pairs = tuple(rng.choice(vocabulary) for _ in range(rng.randint(1, 3)))
            if pairs not in exclude:
                exclude.add(pairs)
                out.append(render(pairs))
        return out

    taken: set = set()  # (a held-out phrase appears in no training item, in either direction)
    held_out, training = phrases(150, taken), phrases(600, taken)

    def items(pairs: list, into_xa: bool) -> list:
        if into_xa:
            return [example("to_xa", f"Translate into the Xa language: '{en}'. Answer with the translation only.", xa) for en, xa in pairs]
        return [example("from_xa", f"Translate from the Xa language into English: '{xa}'. Answer with the translation only.", en)
                for en, xa in pairs]  # fmt: skip

    train = items(training[:300], True) + items(training[300:], False)
    rng.shuffle(train)
    return train, items(held_out[:75], True) + items(held_out[75:], False)


def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from peft_sparse.assets import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct")[0])


# ------------------------------------------------------------------ retrieval: read a list given in the prompt
ITEMS = ["kiwi", "lamp", "rope", "vase", "drum", "sock", "bell", "coin", "fork", "mask", "nail", "pear", "ring", "shoe", "tent"]
ORDINALS = ["first", "second", "third", "fourth", "fifth", "sixth"]


def _codes(rng):
    keys = rng.sample(ITEMS, rng.randint(4, 6))
    values = rng.sample(range(10, 100), len(keys))
    return keys, values, "; ".join(f"{k} = {v}" for k, v in zip(keys, values))


def rt_value(rng):
    keys, values, listed = _codes(rng)
    i = rng.randrange(len(keys))
    return f"Codes: {listed}. What is the code of {keys[i]}? Answer with the number only.", str(values[i])


def rt_key(rng):
    keys, values, listed = _codes(rng)
    i = rng.randrange(len(keys))
    return f"Codes: {listed}. Which item has the code {values[i]}? Answer with the item only.", keys[i]


def rt_position(rng):
    keys, _, listed = _codes(rng)
    i = rng.randrange(len(keys))
    return f"Codes: {listed}. Which item is listed {ORDINALS[i]}? Answer with the item only.", keys[i]


def retrieval(rng):
    return draw({"value_of_key": rt_value, "key_of_value": rt_key, "position": rt_position}, 200, 50, rng)


# ------------------------------------------------------------------ instructions: the bundled samples, with a constraint
CONSTRAINTS = {
    "uppercase": ("Write your whole answer in capital letters.", str.upper),
    "brackets": ("Put your answer in square brackets.", lambda a: f"[{a}]"),
    "prefix": ("Start your reply with 'Answer: '.", lambda a: f"Answer: {a}"),
    "exclamation": ("End your answer with an exclamation mark.", lambda a: f"{a}!"),
}


def instructions(rng):
    """The bundled instruction samples (``skills`` and ``skills2``, read with
    :func:`peft_sparse.data.instructions.load_instruction_data`), each question followed by one of four checkable
    output instructions; the answer is the sample's answer in that form. Training items come from the samples'
    training files, held-out items from their held-out files."""
    from peft_sparse.data.instructions import load_instruction_data

    def rows(split):
        return [r for name in ("skills", "skills2") for r in load_instruction_data(HERE / f"{name}_{split}.jsonl")]

    def build(sources, n):
        out = []
        for source in rng.sample(sources, n):
            choices = sorted(c for c in CONSTRAINTS if c != "uppercase" or source["answer"] != source["answer"].upper())
            constraint = rng.choice(choices)  # (capitals only where they change the answer)
            text, form = CONSTRAINTS[constraint]
            out.append(example(constraint, f"{source['prompt'][0]['content']} {text}", form(source["answer"])))
        return out

    return build(rows("train"), 600), build(rows("test"), 160)


# ------------------------------------------------------------------ algorithmic: list and digit operations
def al_maximum(rng):
    xs = rng.sample(range(1, 100), rng.randint(4, 7))
    return f"What is the largest number in this list: {' '.join(map(str, xs))}? Answer with the number only.", str(max(xs))


def al_minimum(rng):
    xs = rng.sample(range(1, 100), rng.randint(4, 7))
    return f"What is the smallest number in this list: {' '.join(map(str, xs))}? Answer with the number only.", str(min(xs))


def al_count(rng):
    xs = [rng.choice("abcd") for _ in range(rng.randint(5, 9))]
    target = rng.choice(xs)
    return f"How many times does '{target}' occur in: {' '.join(xs)}? Answer with the number only.", str(xs.count(target))


def al_digit_sum(rng):
    n = rng.randint(100, 99999)
    return f"What is the sum of the digits of {n}? Answer with the number only.", str(sum(map(int, str(n))))


def algorithmic(rng):
    return draw({"maximum": al_maximum, "minimum": al_minimum, "count": al_count, "digit_sum": al_digit_sum}, 150, 40, rng)


# family → (builder, seed); the split of each family into dev / test is benchmarks/quality.py's TASKS
FAMILIES: dict[str, tuple[Callable, int]] = {
    "sequences": (sequences, 3001),
    "arithmetic": (arithmetic, 3002),
    "formats": (formats, 3003),
    "strings": (strings, 3004),
    "recall": (recall, 3005),
    "classify": (classify, 3006),
    "synlang": (synlang, 3007),
    "retrieval": (retrieval, 3008),
    "instructions": (instructions, 3009),
    "algorithmic": (algorithmic, 3010),
    "facts": (facts, 3011),
}
NEEDS_TOKENIZER = {"synlang"}


def generate(family: str, tokenizer=None) -> tuple[list, list]:
    """(training rows, held-out rows) of ``family``, from its fixed seed."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family={family!r}; families: {sorted(FAMILIES)}")
    build, seed = FAMILIES[family]
    rng = random.Random(seed)
    train, test = build(rng, tokenizer) if family in NEEDS_TOKENIZER else build(rng)
    overlap = {r["prompt"][0]["content"] for r in train} & {r["prompt"][0]["content"] for r in test}
    if overlap:
        raise ValueError(f"{family}: {len(overlap)} held-out prompts also in the training file, e.g. {sorted(overlap)[0]!r}")
    return train, test


def lines(rows: list) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


if __name__ == "__main__":
    chosen = sys.argv[1:] or list(FAMILIES)
    for name in chosen:
        train, test = generate(name)
        (HERE / f"{name}_train.jsonl").write_text(lines(train))
        (HERE / f"{name}_test.jsonl").write_text(lines(test))
        print(f"{name}: {len(train)} training and {len(test)} held-out items over {len({r['skill'] for r in test})} skills")
