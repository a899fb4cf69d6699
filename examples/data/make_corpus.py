"""Write ``corpus.txt``: a small English corpus composed for this project, public domain (CC0).

    python examples/data/make_corpus.py [--kb 320] [--seed 0]

The text is generated from hand-written vocabulary and sentence templates (short fables, number
facts, dialogues, weather reports and recipes), so it has learnable structure at every scale,
from spelling to story shape, and no third-party text. The output is deterministic for a seed.
"""

from __future__ import annotations

import argparse
import pathlib
import random

ANIMALS = ["fox", "heron", "badger", "otter", "crow", "hare", "mole", "wren", "goat", "tortoise",
           "beaver", "owl", "lynx", "sparrow", "toad", "weasel", "deer", "bee", "ant", "salmon"]
PLACES = ["the river bank", "the old mill", "the pine wood", "the salt marsh", "the high meadow",
          "the stone bridge", "the orchard", "the quiet lake", "the valley road", "the cliff top",
          "the reed bed", "the market square", "the birch grove", "the hill farm"]
THINGS = ["a lantern", "a silver bell", "a map", "a basket of plums", "a red kite", "a lost key",
          "a wooden flute", "a jar of honey", "a feather", "a small boat", "a bag of seeds",
          "a woollen hat", "a clay pot", "a letter"]
ADJECTIVES = ["clever", "patient", "proud", "shy", "greedy", "kind", "restless", "careful",
              "sleepy", "brave", "curious", "stubborn", "gentle", "hasty"]
TIMES = ["One morning", "Late in the autumn", "On a windy night", "At the first frost",
         "Early in the spring", "One hot afternoon", "Before the rains came", "At dusk"]
FEELINGS = ["glad", "ashamed", "surprised", "grateful", "worried", "proud", "tired", "content"]
MORALS = ["Slow work is still work.", "A friend in need is a friend indeed.",
          "Look before you leap.", "Many small hands make a light load.",
          "Pride goes before a fall.", "Kindness is never wasted.",
          "What is shared grows, what is hoarded spoils.", "Patience catches more than haste.",
          "Listen first, then speak.", "The road is shorter with company."]
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
           "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen",
           "eighteen", "nineteen", "twenty"]
WEATHER = ["clear skies", "light rain", "heavy showers", "fog in the valleys", "a strong west wind",
           "snow on the hills", "thunder in the evening", "a warm breeze", "frost at dawn"]
FOODS = ["barley", "leeks", "beans", "apples", "oats", "onions", "carrots", "pears", "lentils",
         "cabbage", "turnips", "walnuts"]
VERBS = ["chop", "stir in", "simmer", "add", "roast", "mash", "soak", "toast", "slice", "season"]


def a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def fable(r: random.Random) -> str:
    one, two = r.sample(ANIMALS, 2)
    adj1, adj2 = r.sample(ADJECTIVES, 2)
    place, thing = r.choice(PLACES), r.choice(THINGS)
    lines = [f"The {one.title()} and the {two.title()}", "",
             f"{r.choice(TIMES)}, {a(adj1)} {one} found {thing} near {place}.",
             f"{a(adj2).capitalize()} {two} saw it and said, "
             "\"That is mine, I lost it yesterday.\"",
             f"The {one} did not believe the {two}, and the two of them argued until noon."]
    if r.random() < 0.5:
        lines += [f"At last the {one} said, "
                  "\"Let us share it, and neither of us will be sorry.\"",
                  f"So they shared the {thing.split(' ', 1)[1]}, and both were "
                  f"{r.choice(FEELINGS)}."]
    else:
        third = r.choice([x for x in ANIMALS if x not in (one, two)])
        lines += [f"While they argued, a third animal, {a(third)}, carried it away.",
                  f"The {one} and the {two} went home with nothing and felt "
                  f"{r.choice(FEELINGS)}."]
    lines += [f"Moral: {r.choice(MORALS)}", ""]
    return "\n".join(lines)


def number_facts(r: random.Random) -> str:
    out = []
    for _ in range(r.randint(3, 6)):
        x, y = r.randint(0, 10), r.randint(0, 10)
        op = r.choice(["plus", "times", "minus"])
        if op == "minus" and y > x:
            x, y = y, x
        z = {"plus": x + y, "times": x * y, "minus": x - y}[op]
        if z <= 20:
            out.append(f"{NUMBERS[x].capitalize()} {op} {NUMBERS[y]} is {NUMBERS[z]}.")
        else:
            out.append(f"{NUMBERS[x].capitalize()} {op} {NUMBERS[y]} is {z}.")
    return " ".join(out) + "\n"


def dialogue(r: random.Random) -> str:
    one, two = r.sample(ANIMALS, 2)
    thing, place = r.choice(THINGS), r.choice(PLACES)
    when = r.choice(["this morning", "last night", "an hour ago"])
    feeling = r.choice(FEELINGS)
    reply = r.choice(["Gladly.", "Only if you carry the basket.",
                      f"Not today, I am too {feeling}."])
    return "\n".join([f"{one.upper()}: Have you seen {thing}?",
                      f"{two.upper()}: I saw {thing} near {place}, {when}.",
                      f"{one.upper()}: Will you show me the way?",
                      f"{two.upper()}: {reply}", ""])


def weather(r: random.Random) -> str:
    days = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
    start = r.randrange(7)
    lines = ["Weather for the coming days:"]
    for i in range(r.randint(2, 4)):
        lo = r.randint(-3, 12)
        lines.append(f"  {days[(start + i) % 7]}: {r.choice(WEATHER)}, between {lo} and "
                     f"{lo + r.randint(3, 9)} degrees.")
    return "\n".join(lines) + "\n"


def recipe(r: random.Random) -> str:
    foods = r.sample(FOODS, 3)
    lines = [f"A simple dish of {foods[0]}, {foods[1]} and {foods[2]}.", "Steps:"]
    for i in range(r.randint(3, 5)):
        lines.append(f"{i + 1}. {r.choice(VERBS).capitalize()} the {r.choice(foods)} for "
                     f"{NUMBERS[r.randint(2, 20)]} minutes.")
    lines.append(f"Serves {NUMBERS[r.randint(2, 6)]}.")
    return "\n".join(lines) + "\n"


def corpus(kilobytes: int, seed: int) -> str:
    r = random.Random(seed)
    kinds = [fable, fable, fable, number_facts, dialogue, weather, recipe]
    parts, size = [], 0
    while size < kilobytes * 1024:
        part = r.choice(kinds)(r) + "\n"
        parts.append(part)
        size += len(part)
    return "".join(parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kb", type=int, default=320)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=pathlib.Path,
                   default=pathlib.Path(__file__).with_name("corpus.txt"))
    args = p.parse_args()
    text = corpus(args.kb, args.seed)
    args.out.write_text(text, encoding="ascii")
    print(f"wrote {len(text)} bytes to {args.out}")


if __name__ == "__main__":
    main()
