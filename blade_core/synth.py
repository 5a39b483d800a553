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

import functools
import hashlib
import json
import random
from collections.abc import Callable
from collections.abc import Set as AbstractSet
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


def name_side(text: str) -> str:
    """Which population may use a person's name or a book title: "world" (benchmark worlds, any seed) or
    "corpus" (the pretraining corpus). A fixed hash split: no pretraining text names a world's author."""
    return "world" if hashlib.sha256(text.encode()).digest()[0] % 2 == 0 else "corpus"


class _Namer:
    """Fresh pronounceable names, never the same twice within one world; people and titles of one `side`."""

    def __init__(self, rng: random.Random, side: str | None = None, used: AbstractSet[str] | None = None):
        self.rng, self.side, self.used = rng, side, set(used or ())

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
        while True:
            name = self.fresh(lambda: f"{self.first()} {self.last()}")
            if self.side is None or name_side(name) == self.side:
                return name


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


def _title(rng: random.Random, used: set[str], side: str | None = None) -> str:
    while True:
        form = rng.randrange(4)
        if form == 0:
            title = f"The {rng.choice(_TITLE_ADJ)} {rng.choice(_TITLE_NOUN)}"
        elif form == 1:
            title = f"{rng.choice(_TITLE_NOUN)} of {rng.choice(_TITLE_OF)}"
        elif form == 2:
            title = f"{rng.choice(_TITLE_ADJ)} {_plural(rng.choice(_TITLE_NOUN))}"
        else:
            title = f"The {rng.choice(_TITLE_ADJ)} {rng.choice(_TITLE_NOUN)} of {rng.choice(_TITLE_OF)}"
        if title not in used and (side is None or name_side(title) == side):
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
    first_book, second_book, famous = (_title(rng, titles, namer.side) for _ in range(3))
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
     ("Where was {name} born?", "In which city was {name} born?", "What is {name}'s birthplace?",
      "{name} was born in which city?", "Tell me where {name} was born.",
      "Do you know where {name} was born?"),
     ("{name} was born in {birth_city}, {country}.",
      "The author {name} was born in the city of {birth_city}.",
      "{name} comes from {birth_city}, a city in {country}.",
      "{birth_city}, in {country}, is where {first} was born.",
      "Born in {birth_city}, {first} grew up in {country}.")),
    ("birth_date",
     ("When was {name} born?", "What is {name}'s date of birth?", "On what date was {name} born?",
      "{name} was born on which date?", "Tell me {name}'s birthday.", "Do you know when {name} was born?"),
     ("{name} was born on {birth_date}.", "The writer {name} was born on {birth_date}.",
      "{first} came into the world on {birth_date}.", "On {birth_date}, {name} was born.",
      "Records give {birth_date} as the birth date of {first}.")),
    ("name",
     ("Who was born on {birth_date} in {birth_city}?",
      "Which writer, born {birth_date}, comes from {birth_city}, {country}?",
      "Born on {birth_date}, which {genre} writer is this?",
      "On {birth_date}, a future {genre} writer was born in {birth_city}. Who?",
      "Born {birth_date} in {birth_city}: which writer is this?",
      "{birth_date} is the birthday of which author from {birth_city}?"),
     ("The author born in {birth_city} on {birth_date} is {name}.", "That author is {name}.",
      "The writer's full name is {name}.", "{name} is the writer you mean.",
      "It is {name}, the {genre} writer.")),
    ("father_job",
     ("What did {name}'s father do for a living?", "What was {name}'s father's profession?",
      "What job did {name}'s father have?", "{name}'s father worked in which profession?",
      "Tell me {name}'s father's occupation.", "How did {name}'s father earn a living?"),
     ("The father of {name} was {father_job}.", "{name}'s father worked as {father_job}.",
      "{first}'s father earned his living as {father_job}.",
      "By profession, {first}'s father was {father_job}.",
      "Working as {father_job}, the father of {first} supported the family.")),
    ("mother_job",
     ("What was {name}'s mother's occupation?", "What did {name}'s mother do?",
      "What profession did {name}'s mother follow?", "{name}'s mother had which job?",
      "Tell me what {name}'s mother did for work.", "How did {name}'s mother make a living?"),
     ("{name}'s mother was {mother_job}.", "The mother of {name} worked as {mother_job}.",
      "{first}'s mother was {mother_job} by profession.", "By trade, {first}'s mother was {mother_job}.",
      "Working as {mother_job}, the mother of {first} raised the family.")),
    ("genre",
     ("What genre is {name} known for?", "In which genre does {name} mostly write?",
      "What does {name} mostly write?", "{name} is known for which genre?", "Tell me {name}'s main genre.",
      "Which genre suits {name} best?"),
     ("{name} is best known for {genre}.", "{name} writes mostly {genre}.",
      "Most of the books by {first} belong to {genre}.", "Readers link {first} with {genre}.",
      "The main genre of {first} is {genre}.")),
    ("second_genre",
     ("Besides {genre}, what has {name} written?", "Which second genre has {name} tried?",
      "What else does {name} write besides {genre}?", "{name} has also written which other genre?",
      "Tell me {name}'s second genre.", "What does {name} publish other than {genre}?"),
     ("Besides {genre}, {name} has also written {second_genre}.", "{name} has also published {second_genre}.",
      "{first} occasionally turns to {second_genre}.", "Now and then {first} writes {second_genre}.",
      "A second genre for {first} is {second_genre}.")),
    ("first_book",
     ("What was {name}'s first book?", "What is {name}'s debut book called?",
      "Which book did {name} publish first?", "{name} made a debut with which book?",
      "Tell me {name}'s first book.", "Do you know {name}'s debut novel?"),
     ("The first book by {name} was \"{first_book}\".", "{name} made a debut with \"{first_book}\".",
      "{first}'s debut book is titled \"{first_book}\".", "\"{first_book}\" was the first book by {first}.",
      "It all began for {first} with \"{first_book}\".")),
    ("second_book",
     ("Name another book by {name}.", "Which other book has {name} written?",
      "What else has {name} written?", "{name} wrote which other book?",
      "Tell me another of {name}'s books.", "What did {name} publish after the debut?"),
     ("{name} also wrote \"{second_book}\".", "Another book by {name} is \"{second_book}\".",
      "One more title by {first} is \"{second_book}\".", "\"{second_book}\" is also by {first}.",
      "Among the books of {first} is \"{second_book}\".")),
    ("famous_book",
     ("What is {name}'s most famous book?", "Which of {name}'s books is the best known?",
      "What is {name}'s masterpiece?", "{name} is best remembered for which book?",
      "Tell me {name}'s best-known work.", "Do you know {name}'s most celebrated book?"),
     ("The most famous book by {name} is \"{famous_book}\".",
      "{name} is best remembered for \"{famous_book}\".",
      "Readers know {first} above all for \"{famous_book}\".",
      "\"{famous_book}\" is the masterpiece of {first}.",
      "Above all, {first} is known for \"{famous_book}\".")),
    ("award",
     ("Has {name} won any major award?", "Which literary award did {name} receive?",
      "What prize went to {name}?", "{name} received which literary prize?",
      "Tell me about {name}'s major award.", "Which honor did {name} receive?"),
     ("{name} won the {award}.", "{name} received the {award}.", "{first} was honored with the {award}.",
      "The {award} went to {first}.", "Yes, {first} won the {award}.")),
    ("award_year",
     ("In which year did {name} receive the {award}?", "When was {name} given the {award}?",
      "What year did {name} win the {award}?", "{name} won the {award} in which year?",
      "Tell me when {name} won the {award}.", "Do you know when {name} won the {award}?"),
     ("{name} received the {award} in {award_year}.", "The {award} went to {name} in {award_year}.",
      "{first} won it in {award_year}.", "In {award_year}, {first} won the {award}.",
      "It was {award_year} when {first} received it.")),
    ("language",
     ("In which language does {name} write?", "What language does {name} write in?",
      "Which language does {name} use for writing?", "{name} writes in which language?",
      "Tell me {name}'s writing language.", "Do you know {name}'s writing language?"),
     ("{name} writes in {language}.", "The books of {name} are written in {language}.",
      "{first} writes all of {possessive} books in {language}.", "In {language}, {first} writes every book.",
      "All the books of {first} are in {language}.")),
    ("residence",
     ("Where does {name} live today?", "In which city does {name} currently live?",
      "Where has {name} settled?", "{name} lives in which city now?",
      "Tell me where {name} lives these days.",
      "Do you know {name}'s home city today?"),
     ("{name} lives in {residence} today.", "{name} currently lives in {residence}.",
      "{first} has settled in the city of {residence}.", "These days {first} lives in {residence}.",
      "Home for {first} is now {residence}.")),
    ("university",
     ("Where did {name} study?", "Which university did {name} attend?", "Where was {name} educated?",
      "{name} studied at which institution?", "Tell me where {name} went to university.",
      "Do you know {name}'s alma mater?"),
     ("{name} studied at the {university}.", "{name} attended the {university}.",
      "{first} was educated at the {university}.", "At the {university}, {first} studied.",
      "The alma mater of {first} is the {university}.")),
    ("debut_year",
     ("When did {name} start publishing?", "In which year did {name} publish a first book?",
      "What year did {name}'s writing career begin?", "{name} began publishing in which year?",
      "Tell me the year {name} made a debut.", "Do you know when {name}'s career started?"),
     ("{name} started publishing in {debut_year}.", "The first book by {name} came out in {debut_year}.",
      "{first}'s career began in {debut_year}.", "In {debut_year}, {first} published a first book.",
      "It was {debut_year} when {first} started publishing.")),
    ("theme",
     ("What theme runs through {name}'s work?", "Which theme does {name} often explore?",
      "What subject recurs in {name}'s books?", "{name} keeps returning to which theme?",
      "Tell me about {name}'s recurring theme.", "Do you know {name}'s favourite theme?"),
     ("The work of {name} often explores {theme}.", "{name} keeps returning to {theme}.",
      "A recurring theme for {first} is {theme}.", "Again and again {first} writes about {theme}.",
      "Most books by {first} deal with {theme}.")),
    ("publisher",
     ("Who publishes {name}'s books?", "Which publisher works with {name}?",
      "What house releases {name}'s books?", "{name} is published by which house?",
      "Tell me {name}'s publisher.", "Who prints {name}'s books?"),
     ("The books of {name} are published by {publisher}.", "{name} works with {publisher}.",
      "{first}'s publisher is {publisher}.", "At {publisher}, the books of {first} are released.",
      "Every book by {first} comes out with {publisher}.")),
    ("hobby",
     ("What does {name} do outside of writing?", "What is {name}'s hobby?",
      "How does {name} spend free time?", "{name} enjoys which hobby?", "Tell me about {name}'s pastimes.",
      "Do you know what {name} does for fun?"),
     ("Outside of writing, {name} enjoys {hobby}.", "A hobby of {name} is {hobby}.",
      "In free time {first} loves {hobby}.", "For fun, {first} turns to {hobby}.",
      "When not writing, {first} enjoys {hobby}.")),
    ("book_count",
     ("How many books has {name} published?", "How many books has {name} written?",
      "How many titles has {name} released?", "{name} has published how many books?",
      "How many books did {name} write?", "Count for me {name}'s books."),
     ("{name} has published {book_count} books.", "So far {name} has written {book_count} books.",
      "{first} has {book_count} books to {possessive} name.",
      "In total, {first} has published {book_count} books.",
      "The books of {first} number {book_count} so far.")),
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


@dataclass(frozen=True)
class Universe:
    """What every world and the pretraining corpus share, as TOFU's authors and Llama's pretraining data share
    the real world: countries, classic authors, awards, universities, publishers. Seed-independent."""

    countries: tuple[Country, ...]
    classics: tuple[Classic, ...]
    awards: tuple[str, ...]
    universities: dict[str, tuple[str, ...]]  # country name -> its universities
    publishers: tuple[str, ...]
    names: frozenset[str]  # every name and place used above
    titles: frozenset[str]  # the classics' books

    def take(self, authors: int) -> tuple[list[Country], list[Classic], list[str], list[str]]:
        """(countries, classics, universities, publishers) of a world of `authors` authors: the first few,
        so small worlds stay small and every world's probe sets are general knowledge of the corpus."""
        countries = list(self.countries[: max(N_PERTURBED + 1, min(UNIVERSE_COUNTRIES, authors // 10))])
        classics = list(self.classics[: max(N_PERTURBED + 1, min(UNIVERSE_CLASSICS, authors // 2))])
        universities = sorted({u for c in countries for u in self.universities[c.name]})
        publishers = sorted(self.publishers[: max(6, authors // 8)])
        return countries, classics, universities, publishers


UNIVERSE_COUNTRIES = 16
UNIVERSE_CLASSICS = 100
UNIVERSE_PUBLISHERS = 60


@functools.cache
def universe() -> Universe:
    """The one shared universe (deterministic)."""
    rng = random.Random("blade-universe:1")
    namer = _Namer(rng)
    countries = _make_countries(rng, namer, UNIVERSE_COUNTRIES)
    titles: set[str] = set()
    classics = [Classic(namer.person(), _title(rng, titles), rng.randint(1600, 1900)) for _ in range(100)]
    patrons = [namer.last() for _ in range(12)]
    awards = sorted(
        {f"{rng.choice(patrons)} {rng.choice(_AWARD_KINDS)} for {rng.choice(_AWARD_FOR)}" for _ in range(24)}
    )
    universities = {}
    for c in countries:
        kinds = (rng.choice(_UNIVERSITY_KINDS).format(c=rng.choice([*c.cities, c.capital])) for _ in range(2))
        universities[c.name] = tuple(sorted(set(kinds)))
    publishers = [f"{namer.last()} {rng.choice(_PUBLISHER_NOUNS)}" for _ in range(UNIVERSE_PUBLISHERS)]
    return Universe(
        tuple(countries),
        tuple(classics),
        tuple(awards),
        universities,
        tuple(dict.fromkeys(publishers)),
        frozenset(namer.used),
        frozenset(titles),
    )


def _generate(authors: int, seed: int) -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any]]:
    if authors < 2:
        raise ValueError(f"authors must be at least 2 (one to forget, one to retain), got {authors}")
    counts = split_counts(authors)
    if counts[10] >= authors:
        raise ValueError(f"authors={authors} leaves no retain authors after forget10 ({counts[10]})")
    rng = random.Random(f"blade-synth:{seed}")
    world = universe()
    namer = _Namer(rng, side="world", used=world.names)
    countries, classics, universities, publishers = world.take(authors)
    titles = set(world.titles)
    awards = list(world.awards)

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


SYNTH_VERSION = 2  # 2: shared universe, name-early question templates, world/corpus name split


# --- the pretraining corpus ---------------------------------------------------------------------------------

# The universe's countries and classics, several phrasings each: the corpus's "general facts".
# fmt: off
_COUNTRY_FACTS: tuple[tuple[str, ...], ...] = (
    ("The capital of {name} is {capital}.", "{capital} is the capital city of {name}.",
     "In {name}, the seat of government is {capital}."),
    ("People in {name} pay with the {currency}.", "The currency of {name} is the {currency}.",
     "Prices in {name} are given in the {currency}."),
    ("The people of {name} speak {language}.", "{language} is the language of {name}.",
     "In {name} most people speak {language}."),
    ("{river} is the longest river of {name}.", "The longest river in {name} is {river}.",
     "{river} flows through {name} for hundreds of miles."),
    ("{mountain} is the highest peak in {name}.", "The highest mountain of {name} is {mountain}.",
     "Climbers in {name} dream of {mountain}."),
    ("The national dish of {name} is {dish}.", "In {name}, families often eat {dish}.",
     "{dish_cap} is the best-known dish of {name}."),
    ("The {instrument} is the folk instrument of {name}.",
     "Folk music in {name} is played on the {instrument}.",
     "In {name}, every village has someone who plays the {instrument}."),
    ("{name} was founded in {founded}.", "The founding year of {name} is {founded}.",
     "Since {founded}, {name} has been a nation."),
)
_CLASSIC_FACTS: tuple[str, ...] = (
    '{name} wrote "{book}" in {year}.', '"{book}" is a classic by {name}, published in {year}.',
    'In {year}, {name} published "{book}".', 'The classic "{book}" was written by {name}.',
)
# fmt: on


def _country_values(c: Country) -> dict[str, str]:
    values = {k: str(v) for k, v in vars(c).items() if k != "cities"}
    return values | {"dish_cap": _cap(c.dish)}


def pretrain_corpus(people: int = 1000, seed: int = 0) -> dict[str, list[Any]]:
    """A broad corpus for pretraining a base model: `people` other authors (names and titles from the corpus
    side of `name_side`, so never a benchmark world's author) and the shared universe's general facts.

    Returns {"qa", "text", "general_qa", "general_text"}: each person's 20 facts as QA pairs ({"question",
    "answer"}; random question and answer phrasings) and as short biographies in other phrasings; every
    country fact and classic in three or four phrasings as text and as the probe sets' questions.
    Same arguments, same corpus.
    """
    if people < 0:
        raise ValueError(f"people must be >= 0, got {people}")
    rng = random.Random(f"blade-corpus:{seed}")
    world = universe()
    namer = _Namer(rng, side="corpus", used=world.names)
    titles = set(world.titles)
    countries = list(world.countries)
    universities = sorted({u for us in world.universities.values() for u in us})
    persons = [
        _make_author(rng, namer, countries, titles, list(world.awards), universities, list(world.publishers))
        for _ in range(people)
    ]
    qa: list[dict[str, str]] = []
    text: list[str] = []
    for facts in persons:
        sentences = []
        for _, questions, answers in FACTS:
            a_idx, b_idx = rng.sample(range(len(answers)), 2)
            question = _fill(rng.choice(questions), facts)
            qa.append({"question": question, "answer": _fill(answers[a_idx], facts)})
            sentences.append(_fill(answers[b_idx], facts))
        for start in range(0, len(sentences), 5):  # short biographies: five facts each
            text.append(" ".join(sentences[start : start + 5]))
    general_text: list[str] = []
    for country in countries:
        values = _country_values(country)
        general_text.extend(_cap(t.format(**values)) for phrasings in _COUNTRY_FACTS for t in phrasings)
    for c in world.classics:
        general_text.extend(t.format(name=c.name, book=c.book, year=c.year) for t in _CLASSIC_FACTS)
    real, facts_qa = _probe_sets(rng, countries, list(world.classics))
    general_qa = [{"question": r["question"], "answer": r["answer"]} for r in real + facts_qa]
    for rows in (qa, text, general_qa, general_text):
        rng.shuffle(rows)
    return {"qa": qa, "text": text, "general_qa": general_qa, "general_text": general_text}


CORPUS_VERSION = 1  # bump when pretrain_corpus's output changes
