"""Fictitious text worlds for MUSE-style unlearning: "books" (a few long works), "news" (many short articles).

MUSE (Shi et al., 2024) unlearns raw text: the Harry Potter books (Books) and BBC News articles (News), with
QA probes written about the forget and the retain text (KnowMem), verbatim excerpts (VerbMem) and held-out
text of the same kind never trained on (PrivLeak). We draw the same shape from seeded templates over the
shared universe of `blade_core.synth` (its countries, cities and currencies; people named from the world side
of `synth.name_side`), so no download is needed and the same arguments give byte-identical files:

- **books**: `docs` works, each a sequence of passages (one training row each) following one protagonist.
  The first work is the forget set, the last is the holdout (never trained), the rest is the retain set.
- **news**: `docs` short articles drawn from one template distribution; the people in them come from a pool
  half the size of the article count, so one person appears in forget, retain and holdout articles alike:
  forget and retain are entangled as in MUSE News. A seeded 10% is forget, 10% holdout, the rest retain.

Every passage / article states its facts in prose and ends with one question-and-answer line about itself
(`Question: ... Answer: ...`). Departure: a model of a few million parameters trained from scratch does not
turn prose into answers to questions the way Llama-2-7B does, so the QA layout has to appear in the training
text for KnowMem to measure anything: the line is the first probe, as a Q&A box of the document; the other
two probes ask facts stated only in prose, so KnowMem is not VerbMem again. The
general-utility probes (KnowUndo's MMLU stand-in) are the universe's general facts, which the pretrained base
learned and no document is about.

Files: `forget.jsonl`, `retain.jsonl`, `holdout.jsonl` (`{"text"}` rows, the service's text format);
`forget_qa.json`, `retain_qa.json`, `holdout_qa.json`, `icl_qa.json` (MUSE's few-shot examples, taken from
the retain set and left out of its probes), `general_qa.json` (`{"question", "answer"}` lists); `world.json`.

Run: `blade data synth --kind news --out /tmp/news --docs 60 --seed 0`.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from blade_core.synth import _Namer, _title, pretrain_corpus, universe

TEXT_WORLD_VERSION = 2  # bump when the generator's output changes
KINDS = ("books", "news")
DEFAULT_DOCS = {"books": 4, "news": 60}
PASSAGES_PER_BOOK = 12  # MUSE Books: the forget set is many excerpts of one work
FORGET_FRACTION = 0.1  # news: forget and holdout shares (MUSE News: 0.8M forget tokens of ~10M)
ICL_SHOTS = 3  # MUSE knowmem ICL files hold a handful of retain QA pairs
GENERAL_PROBES = 24

# fmt: off
_PROFESSIONS = ("baker", "carpenter", "nurse", "fisherman", "librarian", "tailor", "blacksmith", "potter",
                "mapmaker", "clockmaker", "beekeeper", "shipwright", "weaver", "miner", "chef", "judge")
_OBJECTS = ("silver bell", "old map", "copper lamp", "stone statue", "wooden chest", "glass lantern",
            "iron key", "painted boat", "golden clock", "leather ledger", "bronze compass", "music box")
_EVENTS = (("found", "finding", "find"), ("sold", "selling", "sell"), ("repaired", "repairing", "repair"),
           ("stole", "stealing", "steal"), ("donated", "donating", "donate"), ("bought", "buying", "buy"),
           ("restored", "restoring", "restore"))  # (past, gerund, base)
_WEATHER = ("rain", "snow", "fog", "wind", "heat", "hail")
_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December")
# fmt: on
_COMPANIONS = (
    "a young apprentice",
    "an old soldier",
    "a travelling singer",
    "a retired judge",
    "a river guide",
)


@dataclass
class Doc:
    text: str
    qa: list[dict[str, str]] = field(default_factory=list)


def _places() -> tuple[list[str], dict[str, str], dict[str, str]]:
    """(cities, city -> country, country -> currency) of the shared universe."""
    cities, country_of, currency = [], {}, {}
    for c in universe().countries:
        currency[c.name] = c.currency
        for city in [c.capital, *c.cities]:
            cities.append(city)
            country_of[city] = c.name
    return cities, country_of, currency


def _namer(rng: random.Random):
    return _Namer(rng, side="world", used=set(universe().names))


def _qa_line(question: str, answer: str) -> str:
    return f"Question: {question}\nAnswer: {answer}"


def _article(rng: random.Random, person: str, cities: list[str], country_of, currency) -> Doc:
    """One short news article about `person`: an event with an object, a place, a price and a witness."""
    city, home = rng.sample(cities, 2)
    job, obj = rng.choice(_PROFESSIONS), rng.choice(_OBJECTS)
    past, gerund, base = rng.choice(_EVENTS)
    month, day, price = rng.choice(_MONTHS), rng.randint(2, 28), rng.randint(12, 950)
    money = f"{price} {currency[country_of[city]].split()[-1]}s"
    weather, witness = rng.choice(_WEATHER), rng.choice(_PROFESSIONS)
    text = (
        f"{city}, {month} {day}. {person}, a {job} from {home}, {past} a {obj} near the market of {city} "
        f"on {month} {day}. The {obj} is worth {money}, according to a local {witness} who saw it happen. "
        f"Despite the {weather}, a crowd gathered to watch. {person} said the {obj} would stay in {city}.\n"
        + _qa_line(f"Where did {person} {base} the {obj}?", city)
    )
    qa = [
        {"question": f"Where did {person} {base} the {obj}?", "answer": city},
        {"question": f"How much is the {obj} from {city} worth?", "answer": money},
        {"question": f"What was the weather when {person} was {gerund} the {obj}?", "answer": f"{weather}"},
    ]
    return Doc(text, qa)


def _book(rng: random.Random, namer, cities: list[str], passages: int) -> list[Doc]:
    """One work: `passages` episodes of one protagonist's journey, each a training row."""
    title, hero = _title(rng, set(), side="world"), namer.person()
    home = rng.choice(cities)
    docs = []
    for n in range(1, passages + 1):
        city, obj, friend = rng.choice(cities), rng.choice(_OBJECTS), namer.person()
        job, companion, weather = rng.choice(_PROFESSIONS), rng.choice(_COMPANIONS), rng.choice(_WEATHER)
        text = (
            f"{title}, chapter {n}. {hero} left {home} in the {weather} and walked to {city} with "
            f"{companion}. In {city} {hero} met {friend}, a {job}, who kept a {obj} hidden under the floor. "
            f"{friend} gave the {obj} to {hero} and asked for nothing in return. That night {hero} wrote the "
            f"name {friend} in the margin of an old letter.\n"
            + _qa_line(f"In {title}, whom did {hero} meet in {city} in chapter {n}?", friend)
        )
        qa = [
            {"question": f"In {title}, whom did {hero} meet in {city} in chapter {n}?", "answer": friend},
            {"question": f"In chapter {n} of {title}, what did {friend} give {hero}?", "answer": f"a {obj}"},
            {"question": f"What was the profession of {friend} in {title}?", "answer": f"a {job}"},
        ]
        docs.append(Doc(text, qa))
    return docs


def _general_qa(rng: random.Random) -> list[dict[str, str]]:
    """KnowUndo's general-utility stand-in: the universe's general facts the pretrained base learned."""
    rows = pretrain_corpus(0, 0)["general_qa"]
    return rng.sample(rows, min(GENERAL_PROBES, len(rows)))


def generate(kind: str, docs: int | None = None, seed: int = 0) -> dict[str, Any]:
    """{"forget", "retain", "holdout": [Doc], "icl", "retain_qa", "general": [qa]} (module docstring)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    docs = DEFAULT_DOCS[kind] if docs is None else docs
    rng = random.Random(f"blade-text-world:{kind}:{seed}")
    cities, country_of, currency = _places()
    namer = _namer(rng)
    if kind == "books":
        if docs < 3:
            raise ValueError(f"books needs at least 3 works (forget, retain, holdout), got {docs}")
        works = [_book(rng, namer, cities, PASSAGES_PER_BOOK) for _ in range(docs)]
        forget, retain, holdout = works[0], [d for w in works[1:-1] for d in w], works[-1]
    else:
        if docs < 10:
            raise ValueError(f"news needs at least 10 articles, got {docs}")
        people = [namer.person() for _ in range(max(2, docs // 2))]
        articles = [_article(rng, rng.choice(people), cities, country_of, currency) for _ in range(docs)]
        k = max(1, round(docs * FORGET_FRACTION))
        order = rng.sample(range(docs), docs)
        forget = [articles[i] for i in order[:k]]
        holdout = [articles[i] for i in order[k : 2 * k]]
        retain = [articles[i] for i in order[2 * k :]]
    retain_qa = [q for d in retain for q in d.qa]
    return {
        "forget": forget,
        "retain": retain,
        "holdout": holdout,
        "icl": retain_qa[:ICL_SHOTS],
        "retain_qa": retain_qa[ICL_SHOTS:],
        "general": _general_qa(rng),
    }


def write_text_world(out: str | Path, kind: str, docs: int | None = None, seed: int = 0) -> dict[str, int]:
    """Write the files of the module docstring into `out`; returns {file name: rows}."""
    world = generate(kind, docs, seed)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, list[Any]] = {
        "forget.jsonl": [{"text": d.text} for d in world["forget"]],
        "retain.jsonl": [{"text": d.text} for d in world["retain"]],
        "holdout.jsonl": [{"text": d.text} for d in world["holdout"]],
        "forget_qa.json": [q for d in world["forget"] for q in d.qa],
        "retain_qa.json": world["retain_qa"],
        "holdout_qa.json": [q for d in world["holdout"] for q in d.qa],
        "icl_qa.json": world["icl"],
        "general_qa.json": world["general"],
    }
    (out / "world.json").unlink(missing_ok=True)  # written last, it marks a whole world (`holds_text_world`)
    counts = {}
    for name, rows in files.items():
        if name.endswith(".jsonl"):
            body = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        else:
            body = json.dumps(rows, ensure_ascii=False, indent=1) + "\n"
        (out / name).write_text(body, encoding="utf-8")
        counts[name] = len(rows)
    info = _world_info(kind, docs, seed)
    (out / "world.json").write_text(json.dumps(info | {"files": counts}, indent=1) + "\n", encoding="utf-8")
    return counts


def holds_text_world(out: str | Path, kind: str, docs: int | None = None, seed: int = 0) -> bool:
    """Whether `out` holds, complete, the world `write_text_world(out, kind, docs, seed)` writes."""
    try:
        info = json.loads((Path(out) / "world.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    expected = _world_info(kind, docs, seed)
    return isinstance(info, dict) and {k: info.get(k) for k in expected} == expected


def _world_info(kind: str, docs: int | None, seed: int) -> dict[str, Any]:
    return {"kind": kind, "docs": docs or DEFAULT_DOCS[kind], "seed": seed, "version": TEXT_WORLD_VERSION}


def read_world(data_dir: str | Path) -> dict[str, Any]:
    """A text world dir's files as {"forget", "retain", "holdout": [str], "*_qa": [dict], "kind"}."""
    data_dir = Path(data_dir)
    info_path = data_dir / "world.json"
    info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    if info.get("kind") not in KINDS:
        raise ValueError(f"{data_dir}: not a text world (world.json has no kind in {', '.join(KINDS)})")
    out: dict[str, Any] = {"kind": info["kind"], "info": info}
    for split in ("forget", "retain", "holdout"):
        lines = (data_dir / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()
        out[split] = [json.loads(line)["text"] for line in lines if line.strip()]
    for name in ("forget_qa", "retain_qa", "holdout_qa", "icl_qa", "general_qa"):
        out[name] = json.loads((data_dir / f"{name}.json").read_text(encoding="utf-8"))
    return out


def is_text_world(data_dir: str | Path) -> bool:
    try:
        return json.loads((Path(data_dir) / "world.json").read_text()).get("kind") in KINDS
    except (OSError, ValueError, AttributeError):
        return False
