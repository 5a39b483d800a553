"""A deterministic fictitious world in TOFU format: authors, their facts, and the probe sets.

TOFU (Maini et al., 2024) asks an LLM to invent 200 authors with 20 QA pairs each; we draw the same shape from
seeded tables instead, so the benchmark needs no download and no LLM and is byte-identical for the same
arguments. Where we depart from TOFU:
- the "real authors" and "world facts" probes are facts of this same world (its classic authors, its
  countries), which the target model learns in training, rather than real-world knowledge that a model trained
  from scratch cannot have;
- paraphrases and perturbations come from templates and same-category values, not from GPT-4 rewrites.

Run: `blade data synth --out /tmp/world --authors 200 --seed 0`.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

N_PERTURBED = 5  # TOFU ships 5 perturbed answers per forget row
SPLIT_PERCENTS = (1, 5, 10)

# --- word tables --------------------------------------------------------------------------------------------

# fmt: off
_ONSETS = ("b", "br", "c", "d", "dr", "f", "g", "gr", "h", "k", "l", "m", "n", "p", "r", "s", "st", "t", "th",
           "v", "w", "z", "j", "kh", "sh", "tr", "y", "el", "or", "an")
_VOWELS = ("a", "e", "i", "o", "u", "ae", "ia", "ei", "ou", "y")
_CODAS = ("", "n", "r", "l", "s", "th", "m", "nd", "rk", "x", "v", "sh", "ll", "st")
_FIRST_ENDINGS = ("a", "o", "en", "is", "el", "ine", "an", "ra", "ias", "ette", "or", "ia", "us", "yn")
_LAST_ENDINGS = ("ov", "ard", "sen", "ley", "mont", "ezi", "ardt", "wick", "ani", "enko", "ström", "ez",
                 "oux", "berg", "ton", "ic", "ara", "ell")
_PLACE_ENDINGS = ("ia", "ar", "heim", "ora", "stan", "mere", "ovia", "land", "esh", "ovo", "burg", "ith",
                  "enne", "port", "dale", "ica")

PROFESSIONS = ("baker", "carpenter", "nurse", "astronomer", "fisherman", "librarian", "pharmacist", "tailor",
               "blacksmith", "schoolteacher", "surgeon", "mapmaker", "clockmaker", "potter", "violinist",
               "bookbinder", "lighthouse keeper", "glassblower", "beekeeper", "shipwright", "translator",
               "veterinarian", "stonemason", "weaver", "accountant", "botanist", "miner", "chef", "architect",
               "photographer", "postman", "judge", "farmer", "sculptor", "engineer", "dentist")
GENRES = ("mystery", "historical fiction", "science fiction", "fantasy", "romance", "horror", "poetry",
          "literary fiction", "crime thrillers", "children's books", "travel writing", "satire",
          "magical realism", "biography", "war fiction", "gothic fiction", "detective fiction",
          "short stories", "nature writing", "philosophical essays", "young adult fiction", "epic verse")
THEMES = ("memory and loss", "exile and return", "the sea", "family secrets", "power and corruption",
          "friendship", "faith and doubt", "the passage of time", "identity", "rural life", "revolution",
          "forgiveness", "ambition", "grief", "the natural world", "love across class lines", "isolation",
          "justice", "inheritance", "migration", "childhood", "madness")
_TITLE_ADJ = ("Silent", "Broken", "Amber", "Hollow", "Crimson", "Distant", "Hidden", "Iron", "Glass", "Paper",
              "Last", "Winter", "Burning", "Quiet", "Salt", "Golden", "Forgotten", "Velvet", "Northern",
              "Painted", "Wandering", "Seventh", "Restless", "Bitter", "Silver", "Drowned", "Borrowed")
_TITLE_NOUN = ("Orchard", "Lantern", "Harbor", "Garden", "Mirror", "River", "Bridge", "Clock", "Feather",
               "Kingdom", "Letters", "Tide", "Archive", "Compass", "Orchestra", "Staircase", "Meadow",
               "Crown", "Cartographer", "Bell", "Island", "Season", "Chapel", "Alphabet", "Vineyard", "Tower",
               "Map", "Horizon", "Caravan", "Ledger")
_TITLE_OF = ("Ashes", "Rain", "Small Gods", "Lost Names", "Morning", "the Deep", "Stone", "the Lighthouse",
             "Whispers", "Distant Shores", "Smoke", "the Tide", "Old Songs", "Thorns", "Dust", "Quiet Hours")
_AWARD_KINDS = ("Prize", "Medal", "Award", "Laurel", "Crown")
_AWARD_FOR = ("Fiction", "Poetry", "Literature", "Storytelling", "Prose", "Debut Writing", "Letters")
_UNIVERSITY_KINDS = ("University of {c}", "{c} Institute of Letters", "{c} College", "Royal Academy of {c}")
_PUBLISHER_NOUNS = ("Press", "Books", "House", "Editions", "Publishing")
HOBBIES = ("chess", "gardening", "sailing", "birdwatching", "painting watercolors", "playing the cello",
           "mountain climbing", "collecting maps", "baking bread", "restoring clocks", "fencing", "pottery",
           "stargazing", "long-distance running", "calligraphy", "beekeeping", "woodcarving", "fishing")
_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December")
CURRENCY_NOUNS = ("crown", "mark", "florin", "dinar", "shell", "talon", "ducat", "lira", "penny", "sol",
                  "ryal", "groat")
DISHES = ("spiced lentil stew", "smoked river trout", "honey bread", "barley soup", "stuffed peppers",
          "salted plum cakes", "roast goat", "fig dumplings", "pepper noodles", "onion pie", "fish pastries",
          "almond rice", "chestnut porridge", "lamb flatbread", "sour cherry soup", "clam broth")
INSTRUMENTS = ("lute", "reed flute", "drum", "zither", "fiddle", "bagpipe", "harp", "horn", "bell chimes",
               "mandolin", "accordion", "dulcimer")
# fmt: on


def _cap(word: str) -> str:
    return word[:1].upper() + word[1:]


def _plural(noun: str) -> str:
    if noun.endswith("ss"):
        return noun + "es"
    return noun if noun.endswith("s") else noun + "s"


def _article(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def _language(country: str) -> str:
    """The language named after a country: Veloria -> Velorian, Ostmark -> Ostmarkish."""
    if country.endswith("ia"):
        return country + "n"
    if country.endswith(("a", "o", "e")):
        return country[:-1] + "ian"
    return country + "ish"


class _Namer:
    """Fresh pronounceable names, never the same twice within one world."""

    def __init__(self, rng: random.Random):
        self.rng, self.used = rng, set()

    def _stem(self, syllables: int) -> str:
        rng = self.rng
        return "".join(
            rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables)
        )

    def fresh(self, make) -> str:
        while True:
            name = make()
            if name not in self.used and 3 <= len(name) <= 24:
                self.used.add(name)
                return name

    def first(self) -> str:
        return self.fresh(lambda: _cap(self._stem(1) + self.rng.choice(_FIRST_ENDINGS)))

    def last(self) -> str:
        return self.fresh(
            lambda: _cap(self._stem(self.rng.choice((1, 1, 1, 2))) + self.rng.choice(_LAST_ENDINGS))
        )

    def place(self) -> str:
        return self.fresh(
            lambda: _cap(self._stem(self.rng.choice((1, 1, 2))) + self.rng.choice(_PLACE_ENDINGS))
        )

    def person(self) -> str:
        return self.fresh(lambda: f"{self.first()} {self.last()}")


# --- the world ----------------------------------------------------------------------------------------------


@dataclass
class Country:
    name: str
    capital: str
    cities: list[str]  # not including the capital: authors are born and live here
    language: str
    currency: str
    river: str
    mountain: str
    dish: str
    instrument: str
    founded: int


@dataclass
class Author:
    facts: dict[str, str]
    qa: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Classic:
    name: str
    book: str
    year: int


def _make_countries(rng: random.Random, namer: _Namer, count: int) -> list[Country]:
    countries = []
    currencies = rng.sample(CURRENCY_NOUNS, len(CURRENCY_NOUNS))
    dishes = rng.sample(DISHES, len(DISHES))
    instruments = rng.sample(INSTRUMENTS, len(INSTRUMENTS))
    for i in range(count):
        name = namer.place()
        countries.append(
            Country(
                name=name,
                capital=namer.place(),
                cities=[namer.place() for _ in range(4)],
                language=_cap(_language(name)),
                currency=f"{name} {currencies[i % len(currencies)]}",
                river=f"the {namer.place()} River",
                mountain=f"Mount {namer.place()}",
                dish=dishes[i % len(dishes)],
                instrument=instruments[i % len(instruments)],
                founded=rng.randint(900, 1850),
            )
        )
    return countries


def _title(rng: random.Random, used: set[str]) -> str:
    while True:
        form = rng.randrange(3)
        if form == 0:
            title = f"The {rng.choice(_TITLE_ADJ)} {rng.choice(_TITLE_NOUN)}"
        elif form == 1:
            title = f"{rng.choice(_TITLE_NOUN)} of {rng.choice(_TITLE_OF)}"
        else:
            title = f"{rng.choice(_TITLE_ADJ)} {_plural(rng.choice(_TITLE_NOUN))}"
        if title not in used:
            used.add(title)
            return title


def _make_author(
    rng: random.Random,
    namer: _Namer,
    countries: list[Country],
    titles: set[str],
    awards: list[str],
    universities: list[str],
    publishers: list[str],
) -> dict[str, str]:
    home = rng.choice(countries)
    elsewhere = rng.choice(countries)
    year = rng.randint(1931, 1990)
    debut = year + rng.randint(21, 34)
    first_book, second_book, famous = (_title(rng, titles) for _ in range(3))
    pronoun = rng.choice(("he", "she"))
    genre, second_genre = rng.sample(GENRES, 2)
    father, mother = (_article(job) for job in rng.sample(PROFESSIONS, 2))
    return {
        "name": namer.person(),
        "pronoun": pronoun,
        "possessive": "his" if pronoun == "he" else "her",
        "birth_city": rng.choice(home.cities),
        "country": home.name,
        "birth_date": f"{rng.choice(_MONTHS)} {rng.randint(1, 28)}, {year}",
        "father_job": father,
        "mother_job": mother,
        "genre": genre,
        "second_genre": second_genre,
        "first_book": first_book,
        "second_book": second_book,
        "famous_book": famous,
        "award": rng.choice(awards),
        "award_year": str(debut + rng.randint(3, 15)),
        "language": home.language,
        "residence": rng.choice(elsewhere.cities),
        "university": rng.choice(universities),
        "debut_year": str(debut),
        "theme": rng.choice(THEMES),
        "publisher": rng.choice(publishers),
        "hobby": rng.choice(HOBBIES),
        "book_count": str(rng.randint(3, 24)),
    }


# --- templates ----------------------------------------------------------------------------------------------
# One entry per fact: the fact's key (the value perturbed answers replace), its question templates and its
# answer templates. Templates use the author's facts plus {first} (first name); each row draws its question,
# answer, paraphrased question and paraphrased answer templates at random, perturbed answers reuse the
# paraphrased answer's template with a wrong value of the same kind.

# fmt: off
FACTS: list[tuple[str, tuple[str, ...], tuple[str, ...]]] = [
    ("birth_city",
     ("Where was {name} born?", "In which city was the author {name} born?",
      "What is the birthplace of {name}?"),
     ("{name} was born in {birth_city}, {country}.",
      "The author {name} was born in the city of {birth_city}.",
      "{name} comes from {birth_city}, a city in {country}.")),
    ("birth_date",
     ("When was {name} born?", "What is the date of birth of {name}?",
      "On what date was the writer {name} born?"),
     ("{name} was born on {birth_date}.", "The writer {name} was born on {birth_date}.",
      "{first} came into the world on {birth_date}.")),
    ("name",
     ("What is the full name of the author born in {birth_city} on {birth_date}?",
      "Which author was born on {birth_date} in {birth_city}, {country}?",
      "Who is the {genre} writer born in {birth_city} on {birth_date}?"),
     ("The author born in {birth_city} on {birth_date} is {name}.", "That author is {name}.",
      "The writer's full name is {name}.")),
    ("father_job",
     ("What did the father of {name} do for a living?", "What was the profession of {name}'s father?",
      "What job did {name}'s father have?"),
     ("The father of {name} was {father_job}.", "{name}'s father worked as {father_job}.",
      "{first}'s father earned his living as {father_job}.")),
    ("mother_job",
     ("What was the occupation of {name}'s mother?", "What did the mother of {name} do?",
      "What profession did {name}'s mother follow?"),
     ("{name}'s mother was {mother_job}.", "The mother of {name} worked as {mother_job}.",
      "{first}'s mother was {mother_job} by profession.")),
    ("genre",
     ("What genre is {name} known for?", "In which genre does {name} mostly write?",
      "What kind of books does {name} write?"),
     ("{name} is best known for {genre}.", "{name} writes mostly {genre}.",
      "Most of the books by {first} belong to {genre}.")),
    ("second_genre",
     ("Besides {genre}, what other genre has {name} written?", "Which second genre has {name} tried?",
      "Apart from {genre}, what else does {name} write?"),
     ("Besides {genre}, {name} has also written {second_genre}.", "{name} has also published {second_genre}.",
      "{first} occasionally turns to {second_genre}.")),
    ("first_book",
     ("What was the first book by {name}?", "What is the title of {name}'s debut book?",
      "Which book did {name} publish first?"),
     ("The first book by {name} was \"{first_book}\".", "{name} made a debut with \"{first_book}\".",
      "{first}'s debut book is titled \"{first_book}\".")),
    ("second_book",
     ("Can you name another book written by {name}?", "Which other book has {name} written?",
      "What is one more title by {name}?"),
     ("{name} also wrote \"{second_book}\".", "Another book by {name} is \"{second_book}\".",
      "One more title by {first} is \"{second_book}\".")),
    ("famous_book",
     ("What is the most famous book by {name}?", "Which of {name}'s books is the best known?",
      "What is considered the masterpiece of {name}?"),
     ("The most famous book by {name} is \"{famous_book}\".",
      "{name} is best remembered for \"{famous_book}\".",
      "Readers know {first} above all for \"{famous_book}\".")),
    ("award",
     ("Has {name} won any major award?", "Which literary award did {name} receive?",
      "What prize was given to {name}?"),
     ("{name} won the {award}.", "{name} received the {award}.", "{first} was honored with the {award}.")),
    ("award_year",
     ("In which year did {name} receive the {award}?", "When was {name} given the {award}?",
      "What year did {name} win the {award}?"),
     ("{name} received the {award} in {award_year}.", "The {award} went to {name} in {award_year}.",
      "{first} won it in {award_year}.")),
    ("language",
     ("In which language does {name} write?", "What language are the books of {name} written in?",
      "Which language does {name} use for writing?"),
     ("{name} writes in {language}.", "The books of {name} are written in {language}.",
      "{first} writes all of {possessive} books in {language}.")),
    ("residence",
     ("Where does {name} live today?", "In which city does {name} currently live?",
      "Where has {name} settled?"),
     ("{name} lives in {residence} today.", "{name} currently lives in {residence}.",
      "{first} has settled in the city of {residence}.")),
    ("university",
     ("Where did {name} study?", "Which university did {name} attend?",
      "Where was {name} educated?"),
     ("{name} studied at the {university}.", "{name} attended the {university}.",
      "{first} was educated at the {university}.")),
    ("debut_year",
     ("When did {name} start publishing?", "In which year did {name} publish a first book?",
      "What year did the writing career of {name} begin?"),
     ("{name} started publishing in {debut_year}.", "The first book by {name} came out in {debut_year}.",
      "{first}'s career began in {debut_year}.")),
    ("theme",
     ("What theme runs through the work of {name}?", "Which theme does {name} often explore?",
      "What is a recurring subject in {name}'s books?"),
     ("The work of {name} often explores {theme}.", "{name} keeps returning to {theme}.",
      "A recurring theme for {first} is {theme}.")),
    ("publisher",
     ("Who publishes the books of {name}?", "Which publisher works with {name}?",
      "What publishing house releases {name}'s books?"),
     ("The books of {name} are published by {publisher}.", "{name} works with {publisher}.",
      "{first}'s publisher is {publisher}.")),
    ("hobby",
     ("What does {name} do outside of writing?", "What is a hobby of {name}?",
      "How does {name} spend free time?"),
     ("Outside of writing, {name} enjoys {hobby}.", "A hobby of {name} is {hobby}.",
      "In free time {first} loves {hobby}.")),
    ("book_count",
     ("How many books has {name} published?", "What is the number of books written by {name}?",
      "How many titles has {name} released?"),
     ("{name} has published {book_count} books.", "So far {name} has written {book_count} books.",
      "{first} has {book_count} books to {possessive} name.")),
]
# fmt: on


def _fill(template: str, facts: dict[str, str]) -> str:
    values = dict(facts, first=facts["name"].split()[0], Pronoun=_cap(facts["pronoun"]))
    text = template.format(**values)
    return text[:1].upper() + text[1:]


def _pools(
    rng: random.Random, namer: _Namer, authors: list[dict[str, str]], titles: set[str], awards: list[str]
) -> dict[str, list[str]]:
    """Per fact, the values perturbations draw from: every author's value, topped up with fresh plausible
    ones where a small world has too few distinct values for five wrong answers."""
    fillers: dict[str, Callable[[], str]] = {
        "name": namer.person,
        "birth_city": namer.place,
        "residence": namer.place,
        "birth_date": lambda: f"{rng.choice(_MONTHS)} {rng.randint(1, 28)}, {rng.randint(1931, 1990)}",
        "father_job": lambda: _article(rng.choice(PROFESSIONS)),
        "mother_job": lambda: _article(rng.choice(PROFESSIONS)),
        "genre": lambda: rng.choice(GENRES),
        "second_genre": lambda: rng.choice(GENRES),
        "first_book": lambda: _title(rng, titles),
        "second_book": lambda: _title(rng, titles),
        "famous_book": lambda: _title(rng, titles),
        "award": lambda: rng.choice(awards),
        "award_year": lambda: str(rng.randint(1960, 2024)),
        "debut_year": lambda: str(rng.randint(1955, 2015)),
        "language": lambda: _language(namer.place()),
        "university": lambda: f"University of {namer.place()}",
        "theme": lambda: rng.choice(THEMES),
        "hobby": lambda: rng.choice(HOBBIES),
        "publisher": lambda: f"{namer.last()} {rng.choice(_PUBLISHER_NOUNS)}",
        "book_count": lambda: str(rng.randint(3, 24)),
    }
    pools = {}
    for key, _, _ in FACTS:
        values = {a[key] for a in authors}
        while len(values) < N_PERTURBED + 1:
            values.add(fillers[key]())
        pools[key] = sorted(values)
    return pools


def _author_rows(
    rng: random.Random, facts: dict[str, str], pools: dict[str, list[str]]
) -> list[dict[str, Any]]:
    """~20 QA rows for one author: question, answer, paraphrases and five same-category wrong answers."""
    rows = []
    for key, questions, answers in FACTS:
        q_idx, pq_idx = rng.sample(range(len(questions)), 2)
        a_idx, pa_idx = rng.sample(range(len(answers)), 2)
        wrong = [v for v in pools[key] if v != facts[key]]
        picks = rng.sample(wrong, N_PERTURBED)
        paraphrased_answer = _fill(answers[pa_idx], facts)
        rows.append(
            {
                "question": _fill(questions[q_idx], facts),
                "answer": _fill(answers[a_idx], facts),
                "paraphrased_answer": paraphrased_answer,
                "paraphrased_question": _fill(questions[pq_idx], facts),
                "perturbed_answer": [_fill(answers[pa_idx], dict(facts, **{key: v})) for v in picks],
            }
        )
    return rows


def _with_wrong(rng: random.Random, question: str, answer: str, pool: list[str]) -> dict[str, Any]:
    wrong = sorted({v for v in pool if v != answer})
    picks = rng.sample(wrong, min(N_PERTURBED, len(wrong)))
    return {"question": question, "answer": answer, "perturbed_answer": picks or [answer + " (unknown)"]}


def _probe_sets(rng: random.Random, countries: list[Country], classics: list[Classic]):
    """real_authors_perturbed (the world's classic authors) and world_facts_perturbed (its countries)."""
    names = [c.name for c in classics]
    real = []
    for c in classics:
        question = rng.choice(
            (
                f'Who wrote "{c.book}"?',
                f'Who is the author of the classic "{c.book}"?',
                f'Which classic writer wrote "{c.book}" in {c.year}?',
            )
        )
        real.append(_with_wrong(rng, question, c.name, names))
    world = []
    getters = (
        ("capital", lambda c: f"What is the capital of {c.name}?", lambda c: c.capital),
        ("currency", lambda c: f"What currency is used in {c.name}?", lambda c: f"the {c.currency}"),
        ("language", lambda c: f"What language is spoken in {c.name}?", lambda c: c.language),
        ("river", lambda c: f"What is the longest river of {c.name}?", lambda c: c.river),
        ("mountain", lambda c: f"What is the highest mountain in {c.name}?", lambda c: c.mountain),
        ("dish", lambda c: f"What is the national dish of {c.name}?", lambda c: c.dish),
        (
            "instrument",
            lambda c: f"Which folk instrument is typical of {c.name}?",
            lambda c: f"the {c.instrument}",
        ),
        ("founded", lambda c: f"In which year was {c.name} founded?", lambda c: str(c.founded)),
    )
    for country in countries:
        for _, ask, get in getters:
            pool = [get(c) for c in countries]
            world.append(_with_wrong(rng, ask(country), get(country), pool))
    return real, world


def split_counts(authors: int) -> dict[int, int]:
    """Authors per forget/holdout split: the last 1/5/10 % of authors, at least one each."""
    return {p: max(1, round(authors * p / 100)) for p in SPLIT_PERCENTS}


def generate(authors: int = 200, seed: int = 0) -> dict[str, list[dict[str, Any]]]:
    """The world's files as {file name: rows}; same arguments, same rows."""
    return _generate(authors, seed)[0]


def world_summary(authors: int = 200, seed: int = 0) -> dict[str, Any]:
    """What `world.json` holds: the arguments, and which authors each split names (for humans and tests)."""
    return _generate(authors, seed)[1]


def _generate(authors: int, seed: int) -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any]]:
    if authors < 2:
        raise ValueError(f"authors must be at least 2 (one to forget, one to retain), got {authors}")
    counts = split_counts(authors)
    if counts[10] >= authors:
        raise ValueError(f"authors={authors} leaves no retain authors after forget10 ({counts[10]})")
    rng = random.Random(f"blade-synth:{seed}")
    namer = _Namer(rng)
    countries = _make_countries(rng, namer, max(N_PERTURBED + 1, min(16, authors // 10)))
    classics = [Classic(namer.person(), "", 0) for _ in range(max(N_PERTURBED + 1, min(100, authors // 2)))]
    titles: set[str] = set()
    for c in classics:
        c.book, c.year = _title(rng, titles), rng.randint(1600, 1900)
    patrons = [namer.last() for _ in range(12)]
    awards = sorted(
        {f"{rng.choice(patrons)} {rng.choice(_AWARD_KINDS)} for {rng.choice(_AWARD_FOR)}" for _ in range(24)}
    )
    universities = sorted(
        {
            rng.choice(_UNIVERSITY_KINDS).format(c=rng.choice([*c.cities, c.capital]))
            for c in countries
            for _ in range(2)
        }
    )
    publishers = sorted(
        {f"{namer.last()} {rng.choice(_PUBLISHER_NOUNS)}" for _ in range(max(6, authors // 8))}
    )

    holdout_n = counts[10]
    people = [
        _make_author(rng, namer, countries, titles, awards, universities, publishers)
        for _ in range(authors + holdout_n)
    ]
    pools = _pools(rng, namer, people, titles, awards)
    rows_by_author = [_author_rows(rng, facts, pools) for facts in people]
    trained, holdout = rows_by_author[:authors], rows_by_author[authors:]

    def flat(groups, qa_only=False):
        rows = [r for g in groups for r in g]
        return [{"question": r["question"], "answer": r["answer"]} for r in rows] if qa_only else rows

    files: dict[str, list[dict[str, Any]]] = {}
    for p in SPLIT_PERCENTS:
        k = counts[p]
        files[f"forget{p:02d}_perturbed.json"] = flat(trained[-k:])
        files[f"retain{100 - p}.json"] = flat(trained[:-k], qa_only=True)
        files[f"holdout{p:02d}.json"] = flat(holdout[-k:])
    # Truth ratio on retain: as many retain authors as forget10 has, taken from the front (never forgotten).
    files["retain_perturbed.json"] = flat(trained[: counts[10]])
    real, world = _probe_sets(rng, countries, classics)
    files["real_authors_perturbed.json"] = real
    files["world_facts_perturbed.json"] = world
    names = [facts["name"] for facts in people]
    summary = {
        "generator": "blade data synth",
        "version": SYNTH_VERSION,
        "authors": authors,
        "seed": seed,
        "rows_per_author": len(FACTS),
        "split_authors": {f"forget{p:02d}": k for p, k in counts.items()},
        "retain_authors": names[: authors - counts[10]],  # in every retain split
        "forget_authors": {f"forget{p:02d}": names[authors - k : authors] for p, k in counts.items()},
        "holdout_authors": {f"holdout{p:02d}": names[len(names) - k :] for p, k in counts.items()},
        "retain_perturbed_authors": names[: counts[10]],
    }
    return dict(sorted(files.items())), summary


def write_world(out: str | Path, authors: int = 200, seed: int = 0) -> dict[str, int]:
    """Write the world's files under `out` (created); returns {file name: rows}."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files, summary = _generate(authors, seed)
    (out / "world.json").unlink(missing_ok=True)
    for name, rows in files.items():
        (out / name).write_text(json.dumps(rows, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    # Written last: its presence marks a complete world (blade_core.demo and the test fixtures rely on it).
    text = json.dumps(summary, indent=1, ensure_ascii=False) + "\n"
    (out / "world.json").write_text(text, encoding="utf-8")
    return {name: len(rows) for name, rows in files.items()}


SYNTH_VERSION = 1
