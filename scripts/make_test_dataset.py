"""Generate the small synthetic corpus shipped in ``tests/assets/test_corpus``.

Every sentence comes from templates in this file, filled in by a seeded random generator, so the
output is deterministic and free of third-party text. The corpus has structure a small model can
learn within a hundred steps, and enough distinct words (a few thousand, with generated names and
numbers) to train a ~2k-token BPE vocabulary:

* a fixed fictional *world* (towns with rivers, trades, dishes, founding years; animals with
  sounds and legs), drawn from ``--world-seed`` and shared by both splits, so facts agree;
* stories, scenes and dialogues about a character whose attributes (full name, pet, town, job,
  colour, friend) recur consistently through the piece;
* arithmetic in words and in digits, counting sequences, and shopping lists with correct totals.

Usage::

    python scripts/make_test_dataset.py                     # writes tests/assets/test_corpus
    python scripts/make_test_dataset.py --out-dir /tmp/c --train-bytes 100000
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def _split(s: str) -> list[str]:
    return s.split()


def _pairs(s: str) -> dict[str, str]:
    return dict(item.split(":") for item in s.split())


ONES = _split(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen"
)
TENS = _split("_ _ twenty thirty forty fifty sixty seventy eighty ninety")
GIRLS = _split(
    "Ada Bea Cora Dina Ella Faye Gwen Hana Iris Jill Kira Lena Mia Nora Opal Pia Rosa Sara Tess "
    "Uma Vera Wren Yara Zoe Lucy Maya Nell Ivy Alma Edith Greta Helga Ingrid Joan Mabel Olive"
)
BOYS = _split(
    "Abe Ben Cal Dan Eli Finn Gus Hal Ivan Jack Kai Leo Max Ned Otto Paul Quin Ray Sam Tom Ugo "
    "Vic Walt Yuri Zed Luke Milo Noah Arlo Bruno Cyril Edgar Felix Hugo Jasper Oscar Rufus"
)
SYL_A = _split("Al Bel Cor Dar El Fen Gar Hol Ith Jor Kel Lor Mar Nor Or Per Ros Sel Tor Val Wil")
SYL_B = _split("a an ard en ia ik in is o on or ric wyn ella ius")
SUR_A = _split(
    "Ash Black Bright Cross Fair Gold Green Hart Hill Long Marsh North Red Row Silver Stan Thorn "
    "Whit Wood Win Brook Fern"
)
SUR_B = _split("well wood ley ton field more ridge wick by son worth gate hall ford")
PETS = _pairs(
    "dog:woof cat:meow goat:baa duck:quack owl:hoot cow:moo horse:neigh frog:ribbit hen:cluck "
    "pig:oink mouse:squeak lamb:baa"
)
LEGS = {k: int(v) for k, v in _pairs("spider:8 ant:6 snail:0 crab:10 dog:4 duck:2 owl:2").items()}
LEGS.update({k: 2 if k == "hen" else 4 for k in PETS if k not in LEGS})
PET_NAMES = _split(
    "Pip Rex Bo Dot Fig Gus Moss Nib Pepper Rusty Sox Tuck Wisp Ziggy Biscuit Clover Hazel Maple "
    "Pebble Sunny Button Crumpet Dusty Fudge Juniper Mittens Noodle Pickles Sprout Waffles"
)
COLORS = _split("red blue green yellow purple orange white black brown pink grey silver")
FOODS = _split(
    "apples pears plums cherries carrots beans onions lemons figs grapes peaches potatoes "
    "turnips radishes walnuts chestnuts parsnips cabbages melons apricots"
)
JOBS = _split(
    "baker farmer teacher sailor painter doctor builder fisher miller weaver potter carpenter "
    "blacksmith shepherd gardener tailor cobbler librarian beekeeper clockmaker"
)
PLACES = _split(
    "market river hill forest bridge library harbour garden mill meadow square lake orchard "
    "chapel bakery workshop lighthouse quarry vineyard"
)
ADJS = _split(
    "small big old young quiet loud bright dark warm cold soft hard happy brave shy clever "
    "gentle kind proud busy lazy tall round heavy light fast slow sweet fresh clean dirty empty "
    "full narrow wide deep rough smooth tiny huge golden wooden wet dry sleepy hungry noisy calm "
    "wild strange lucky curious careful cheerful grumpy silly wise eager fancy humble jolly "
    "nimble patient polite rusty shiny sturdy tidy messy dusty muddy crooked striped spotted"
)
NOUNS = _split(
    "basket lantern kettle blanket ladder bucket hammer needle ribbon button candle mirror "
    "window table chair bench barrel wagon sail anchor rope hook shovel rake broom bottle jar "
    "cup bowl spoon loaf kite drum flute fiddle whistle bell clock map book letter parcel coin "
    "purse hat coat scarf glove boot apron feather pebble shell leaf branch acorn flower tulip "
    "daisy mushroom berry hedge fence gate path tower cottage barn stable shed fountain statue "
    "cloud rainbow puddle snowman umbrella pillow teapot wheelbarrow compass telescope"
)
VERBS = _split(
    "found lost carried painted mended fixed cleaned polished opened dropped lifted pushed pulled "
    "hid chased followed watched counted wrapped filled emptied picked sold bought borrowed "
    "returned shared dried folded climbed crossed rolled tossed caught admired measured sketched"
)
DAYS = _split("Monday Tuesday Wednesday Thursday Friday Saturday Sunday")
MONTHS = _split(
    "January February March April May June July August September October November December"
)
TOWN_A = _split(
    "Ash Bram Cold Dun Elm Fern Glen Hol Iron Kel Lark Marsh Nor Oak Pen Red Stone Thorn Wex Yar"
)
TOWN_B = _split("ford bury wick dale ton mere field stead haven moor")
RIVER = _split("Lune Tarn Brisk Wend Olla Senn Marl Ives Coyle Doon")
DISHES = [
    f"{a} {b}"
    for a, b in zip(
        _split("plum fish onion honey bean apple cheese pear"),
        _split("bread stew pie cake soup tart buns jam"),
    )
]
TRADES = _split("wool boats salt pottery rope cider timber lace bells glass")


def words(n: int) -> str:
    """Spell a number from 0 to 999 in English words."""
    if n < 20:
        return ONES[n]
    if n < 100:
        return TENS[n // 10] + ("" if n % 10 == 0 else "-" + ONES[n % 10])
    rest = n % 100
    return ONES[n // 100] + " hundred" + ("" if rest == 0 else " and " + words(rest))


def cap(s: str) -> str:
    return s[:1].upper() + s[1:]


def make_world(seed: int) -> dict:
    """Towns and their fixed facts; identical for every split built with the same seed."""
    rng = random.Random(seed)
    towns = {}
    for name in rng.sample(sorted({a + b for a in TOWN_A for b in TOWN_B}), 40):
        towns[name] = {
            "river": rng.choice(RIVER),
            "dish": rng.choice(DISHES),
            "trade": rng.choice(TRADES),
            "people": rng.randrange(2, 90) * 100,
            "bridges": rng.randrange(2, 9),
            "year": rng.randrange(1100, 1900),
        }
    return towns


def person(rng: random.Random, towns: dict) -> dict:
    girl = rng.random() < 0.5
    first = rng.choice(GIRLS if girl else BOYS)
    if rng.random() < 0.4:
        first = rng.choice(SYL_A) + rng.choice(SYL_B)
    town = rng.choice(sorted(towns))
    return dict(
        towns[town],
        name=first,
        full=f"{first} {rng.choice(SUR_A)}{rng.choice(SUR_B)}",
        he="she" if girl else "he",
        his="her" if girl else "his",
        He="She" if girl else "He",
        His="Her" if girl else "His",
        age=rng.randrange(5, 80),
        town=town,
        pet=(pet := rng.choice(sorted(PETS))),
        sound=PETS[pet],
        pet_name=rng.choice(PET_NAMES),
        color=rng.choice(COLORS),
        food=rng.choice(FOODS),
        job=rng.choice(JOBS),
        friend=rng.choice(GIRLS + BOYS),
        place=rng.choice(PLACES),
        day=rng.choice(DAYS),
        month=rng.choice(MONTHS),
        adj=rng.choice(ADJS),
        adj2=rng.choice(ADJS),
        noun=rng.choice(NOUNS),
        verb=rng.choice(VERBS),
        n=(n := rng.randrange(2, 10)),
        nw=words(n),
    )


STORY_INTROS = [
    "Once there was a {job} named {full} who lived in {town}.",
    "In the town of {town}, by the river {river}, lived {full} the {job}.",
    "{full} was {age} years old and worked as a {job} in {town}.",
]
STORY_EVENTS = [
    "Every morning {pet_name} the {pet} said {sound} and woke {name} up.",
    "On {day}, {name} walked with {pet_name} to the {place}.",
    "{He} bought {nw} {food} at the market and carried them home.",
    "{name} liked the colour {color} more than any other colour.",
    "{His} friend {friend} came to visit and asked about {pet_name}.",
    '"Where is your {pet}?" asked {friend}. "{pet_name} is sleeping," said {name}.',
    "The people of {town} make {trade}, and {name} helped them on {day}.",
    "For supper {name} ate {dish}, the dish {town} is known for.",
    "{name} counted the bridges of {town}: there were {bridges}.",
    "{pet_name} ran down to the river {river} and came back wet.",
    "{name} painted the door {color}, and {pet_name} watched.",
    "{He} gave {nw} {food} to {friend}, who said thank you.",
    "Near the {place}, {name} {verb} a {adj} {noun}. It was {adj2}.",
    "In {month}, {name} and {pet_name} went to see the {adj} {noun} by the {place}.",
]
STORY_ENDS = [
    "At night {pet_name} slept by the fire, and {name} dreamed of {town}.",
    "And so ended a good day for {name} the {job} and {pet_name} the {pet}.",
    "{name} was happy to live in {town} with {pet_name}.",
]


def story(rng: random.Random, towns: dict) -> str:
    p = person(rng, towns)
    events = rng.sample(STORY_EVENTS, rng.randrange(4, 10))
    body = [rng.choice(STORY_INTROS), "{name} had a {pet} called {pet_name}."] + events
    return " ".join(s.format(**p) for s in body + [rng.choice(STORY_ENDS)])


def scene(rng: random.Random, towns: dict) -> str:
    p = person(rng, towns)
    out = [f"{p['full']} the {p['job']} went to the {p['place']} in {p['town']}."]
    for _ in range(rng.randrange(3, 8)):
        adj, noun, verb = rng.choice(ADJS), rng.choice(NOUNS), rng.choice(VERBS)
        out.append(
            rng.choice(
                [
                    f"There {p['he']} {verb} a {adj} {noun}.",
                    f"{p['He']} saw that the {noun} was {adj}.",
                    f"{p['name']} {verb} the {noun} and {p['pet_name']} watched.",
                    f"The {noun} was {adj} and {rng.choice(ADJS)}.",
                ]
            )
        )
    return " ".join(out)


def arithmetic(rng: random.Random, towns: dict) -> str:
    lines = []
    for _ in range(rng.randrange(6, 20)):
        a, b = rng.randrange(0, 50), rng.randrange(0, 50)
        hi, lo = max(a, b), min(a, b)
        lines.append(
            rng.choice(
                [
                    f"{words(a)} plus {words(b)} is {words(a + b)}.",
                    f"{words(hi)} minus {words(lo)} is {words(hi - lo)}.",
                    f"{words(a % 13)} times {words(b % 13)} is {words(a % 13 * (b % 13))}.",
                    f"{a} + {b} = {a + b}",
                    f"{hi} - {lo} = {hi - lo}",
                    f"{a * 37} + {b * 53} = {a * 37 + b * 53}",
                    f"half of {words(2 * a)} is {words(a)}.",
                ]
            )
        )
    return "\n".join(cap(x) for x in lines)


def sequence(rng: random.Random, towns: dict) -> str:
    kind = rng.randrange(5)
    if kind == 0:
        start, step, n = rng.randrange(0, 40), rng.randrange(1, 6), rng.randrange(5, 14)
        seq = [words(start + i * step) for i in range(n)]
        return f"Counting by {words(step)} from {seq[0]}: " + ", ".join(seq) + "."
    if kind == 1:
        start, n = rng.randrange(12, 999), rng.randrange(5, 12)
        return "Counting down: " + ", ".join(str(start - i) for i in range(n)) + "."
    if kind == 2:
        i = rng.randrange(7)
        return f"After {DAYS[i]} comes {DAYS[(i + 1) % 7]}. The days are {', '.join(DAYS)}."
    if kind == 3:
        i, n = rng.randrange(12), rng.randrange(3, 7)
        after = ", ".join(MONTHS[(i + k + 1) % 12] for k in range(n))
        return f"The {words(n)} months after {MONTHS[i]} are {after}."
    i, n = rng.randrange(20), rng.randrange(3, 7)
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    return f"The letters after {letters[i]} are " + " ".join(letters[i + 1 : i + 1 + n]) + "."


DIALOGUE_QA = [
    ("What is your job?", "I am a {job}."),
    ("Do you have a pet?", "Yes, a {pet} called {pet_name}. It says {sound}."),
    ("What is your favourite colour?", "My favourite colour is {color}."),
    ("How old are you?", "I am {agew} years old."),
    ("What do they make in {town}?", "In {town} they make {trade}."),
    ("What do you like to eat?", "I like {food}, and {dish} on feast days."),
    ("When was {town} founded?", "{town} was founded in {year}."),
    ("What is your full name?", "My name is {full}."),
]


def dialogue(rng: random.Random, towns: dict) -> str:
    a, b = person(rng, towns), person(rng, towns)
    b["agew"] = words(b["age"])
    turns = [
        f"{a['name']}: Hello, {b['name']}! Where do you live?",
        f"{b['name']}: I live in {b['town']}, by the river {b['river']}.",
    ]
    for q, ans in rng.sample(DIALOGUE_QA, rng.randrange(2, 7)):
        turns += [f"{a['name']}: " + q.format(**b), f"{b['name']}: " + ans.format(**b)]
    turns.append(f"{a['name']}: Goodbye, {b['name']}. Say hello to {b['pet_name']} for me!")
    return "\n".join(turns)


def facts(rng: random.Random, towns: dict) -> str:
    out = []
    for _ in range(rng.randrange(3, 9)):
        town = rng.choice(sorted(towns))
        t = towns[town]
        animal = rng.choice(sorted(LEGS))
        legs = LEGS[animal]
        out.append(
            rng.choice(
                [
                    f"{town} lies on the river {t['river']}.",
                    f"About {t['people']} people live in {town}.",
                    f"{town} is famous for its {t['trade']} and its {t['dish']}.",
                    f"There are {words(t['bridges'])} bridges in {town}.",
                    f"{town} was founded in the year {t['year']}.",
                    f"A {animal} has {words(legs)} legs." if legs else f"A {animal} has no legs.",
                    f"Two {animal}s have {words(2 * legs)} legs."
                    if legs
                    else f"A {animal} is slow.",
                    f"The {animal} says {PETS[animal]}."
                    if animal in PETS
                    else f"A {animal} is small.",
                ]
            )
        )
    return "Facts:\n" + "\n".join(f"- {x}" for x in out)


def inventory(rng: random.Random, towns: dict) -> str:
    p = person(rng, towns)
    items = rng.sample(FOODS, rng.randrange(2, 6))
    counts = [rng.randrange(2, 10) for _ in items]
    lines = [f"{i + 1}. {words(c)} {item}" for i, (item, c) in enumerate(zip(items, counts))]
    return (
        f"Shopping list for {p['full']} of {p['town']}:\n"
        + "\n".join(lines)
        + f"\nThat is {words(len(items))} kinds of food and {words(sum(counts))} things in all."
    )


KINDS = [
    (story, 30),
    (scene, 10),
    (dialogue, 16),
    (arithmetic, 13),
    (facts, 12),
    (sequence, 9),
    (inventory, 10),
]


def document(rng: random.Random, towns: dict) -> str:
    """One document: one to three pieces, separated by blank lines."""
    fns, weights = zip(*KINDS)
    return "\n\n".join(rng.choices(fns, weights)[0](rng, towns) for _ in range(rng.randrange(1, 4)))


def write_split(path: Path, seed: int, target_bytes: int, towns: dict) -> tuple[int, int]:
    rng = random.Random(seed)
    n_docs = n_bytes = 0
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        while n_bytes < target_bytes:
            line = json.dumps({"text": document(rng, towns)}, ensure_ascii=False) + "\n"
            f.write(line)
            n_docs += 1
            n_bytes += len(line.encode("utf-8"))
    return n_docs, n_bytes


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    default_out = Path(__file__).resolve().parent.parent / "tests/assets/test_corpus"
    ap.add_argument("--out-dir", default=str(default_out))
    ap.add_argument("--train-bytes", type=int, default=3_000_000)
    ap.add_argument("--val-bytes", type=int, default=300_000)
    ap.add_argument("--world-seed", type=int, default=2024, help="seed of the shared facts")
    ap.add_argument("--train-seed", type=int, default=1)
    ap.add_argument("--val-seed", type=int, default=2)
    args = ap.parse_args()
    if args.train_seed == args.val_seed:
        ap.error("--train-seed and --val-seed must differ (validation must be held out)")
    towns = make_world(args.world_seed)
    out = Path(args.out_dir)
    splits = [
        ("train", args.train_seed, args.train_bytes),
        ("validation", args.val_seed, args.val_bytes),
    ]
    for split, seed, size in splits:
        docs, size_b = write_split(out / f"{split}.jsonl", seed, size, towns)
        print(f"{split}: {docs} documents, {size_b} bytes -> {out / f'{split}.jsonl'}")


if __name__ == "__main__":
    main()
