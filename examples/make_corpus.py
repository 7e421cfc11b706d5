"""Write examples/yard.txt: a pretraining corpus generated from a small grammar of the rail yard (nothing downloaded).

    .venv/bin/python examples/make_corpus.py      # rewrites examples/yard.txt, byte for byte the shipped file

examples/corpus.txt (4 KB, about 1,000 tokens) is too small to pretrain on: a model memorises it, and its
held-out tail's loss climbs while the training loss falls. This corpus (350 KB, about 130,000 tokens) is drawn
from one fixed distribution (a seeded random walk through the grammar below), so the last 5% that `trainyard
prepare` holds out is new text of the same kind, and `val_loss` falls as the model learns the grammar
(examples/llama.yaml: 1.38 at step 49, 0.57 at step 299). Its words are those of corpus.txt and finetune.jsonl,
which examples/tokenizer was trained on.
"""

from __future__ import annotations

import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 2026
PARAGRAPHS = 1500

CITIES = ["Denver", "Omaha", "Chicago", "Memphis", "Kansas City", "St. Louis", "Portland", "Dallas", "Boston",
          "Seattle", "Detroit", "Atlanta"]
CARGO = ["grain", "coal", "lumber", "steel coils", "new cars", "gravel", "paper", "chemicals", "cement", "fruit",
         "milk", "machinery"]
CARS = ["boxcar", "hopper", "tank car", "flatcar", "gondola", "reefer", "autorack"]
CREW = ["the night crew", "the yardmaster", "the hump conductor", "the inspectors", "the switch crew",
        "the car man", "the tower operator", "the day crew"]
PLACES = ["the receiving track", "the hump", "the bowl", "the departure yard", "the repair track", "the main line",
          "the lead", "the scale track"]
CHECKS = ["the brakes", "the couplers", "the wheels", "the air hoses", "the hand brakes", "the seals"]
WEATHER = ["rain", "snow", "fog", "wind", "heat", "frost"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


def _time(r: random.Random) -> str:
    return f"{r.randrange(24):02d}:{r.choice(['00', '15', '30', '45'])}"


def _train(r: random.Random) -> str:
    city, cargo, n = r.choice(CITIES), r.choice(CARGO), r.randrange(12, 90)
    track, number = r.randrange(1, 40), r.randrange(100, 999)
    kind = r.choice(CARS)
    lines = [f"Train {number} arrives on track {track} at {_time(r)} with {n} cars.",
             f"The inspectors check {r.choice(CHECKS)} and {r.choice(CHECKS)} of every car.",
             f"Most of its cars are {kind}s of {cargo}, and they are going to {city}.",
             f"The hump engine pushes the cut over the hump, and each {kind} rolls onto track {r.randrange(1, 40)}.",
             f"When the block for {city} is full, {r.choice(CREW)} builds train {number + 1} on {r.choice(PLACES)}.",
             f"Train {number + 1} leaves for {city} at {_time(r)}, {r.choice(['on time', 'late', 'early'])}."]
    return " ".join(lines[:r.randrange(3, len(lines) + 1)])


def _car(r: random.Random) -> str:
    kind, cargo, city = r.choice(CARS), r.choice(CARGO), r.choice(CITIES)
    number, track = r.randrange(1000, 9999), r.randrange(1, 40)
    fault = r.random() < 0.3
    lines = [f"Car {number} is a {kind} loaded with {cargo} for {city}.",
             f"It waits on {r.choice(PLACES)} until {r.choice(CREW)} moves it to track {track}."]
    if fault:
        lines += [f"The car man finds a bad {r.choice(['wheel', 'coupler', 'brake', 'hose'])} on car {number}.",
                  f"Car {number} goes to the repair track, and its {cargo} waits for the next train to {city}."]
    else:
        lines += [f"Car {number} passes the inspection, and it leaves with the next train to {city}."]
    return " ".join(lines)


def _shift(r: random.Random) -> str:
    day, weather = r.choice(DAYS), r.choice(WEATHER)
    crew, place = r.choice(CREW), r.choice(PLACES)
    n, m = r.randrange(2, 12), r.randrange(100, 900)
    lines = [f"On {day} the yard works through the {weather}.",
             f"The shift of {crew} begins at {_time(r)} on {place}.",
             f"By the end of the shift the yard has sorted {m} cars and built {n} trains.",
             f"The yardmaster writes the count in the book: {m} cars, {n} trains, no accidents."]
    return " ".join(lines[:r.randrange(2, len(lines) + 1)])


def corpus(seed: int = SEED, paragraphs: int = PARAGRAPHS) -> str:
    r = random.Random(seed)
    kinds = [_train, _car, _shift]
    return "\n\n".join(r.choice(kinds)(r) for _ in range(paragraphs)) + "\n"


def main() -> None:
    out = HERE / "yard.txt"
    out.write_text(corpus())
    print(f"{out}: {out.stat().st_size} bytes")


if __name__ == "__main__":
    main()
