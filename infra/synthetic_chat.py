"""Deterministic synthetic multi-turn chat corpus for the embedded tiny model pair.

Every conversation is a ``list[dict(role, content)]`` with roles ``"user"``/``"assistant"`` and 2-4
user/assistant exchanges. It is built from *topics*, each of one kind:

* ``fact``   -- personal facts stated by the user, later asked about ("What is my cat called?").
* ``needle`` -- key/value codes with distractors ("the code for ORCHID-27 is 4817"), later looked up.
* ``qa``     -- a short paragraph about a fictional place or person, then span questions.

Values (names, numbers, codes) are drawn at random per conversation, so an answer can only be
read from the context, never memorised. Every value in a statement is directly followed by
punctuation, as in the answer ("Biscuit." / "called Biscuit,"), so that with the tiny models'
tokenizer (spaces attach to the *preceding* word) a value has the same tokens in both places. The corpus lives entirely in the word lists below: no
data files, no network.

Seeds. Each conversation has its own *item seed* derived from ``(stream, seed, index)`` by
:func:`item_seed`: the stream (0 training, 1 held-out, 2 hand-off) occupies bits 32-33 and
the caller's seed the bits above, so training and held-out item seeds are disjoint for *any* pair
of user seeds. :func:`generate_conversations` draws from the training stream, :func:`recall_items`
and :func:`handoff_conversations` from their own held-out streams.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

KINDS = ("fact", "needle", "qa")

TRAIN_STREAM = 0
HELDOUT_STREAM = 1
HANDOFF_STREAM = 2
_STREAMS = (TRAIN_STREAM, HELDOUT_STREAM, HANDOFF_STREAM)
MAX_HANDOFF_TURNS = 12
_INDEX_BITS = 32
_STREAM_BITS = 2

# --- Embedded word lists ------------------------------------------------------------------------

PET_KINDS = ("cat", "dog", "rabbit", "parrot", "hamster", "turtle", "goldfish", "horse", "ferret",
             "pony", "lizard", "goat")
PET_NAMES = (
    "Biscuit", "Pepper", "Maple", "Ziggy", "Noodle", "Pickle", "Mochi", "Juniper", "Waffles",
    "Clover", "Pumpkin", "Sprout", "Toffee", "Bramble", "Pebble", "Muffin", "Nugget", "Sage",
    "Olive", "Rusty", "Cocoa", "Hazel", "Peanut", "Bingo", "Tango", "Fudge", "Marble", "Button",
    "Ginger", "Pixel", "Comet", "Domino", "Echo", "Fable", "Gizmo", "Honey", "Indigo", "Jasper",
    "Kiwi", "Lemon", "Mango", "Nova", "Oreo", "Pluto", "Quincy", "Rocket", "Scout", "Truffle",
    "Velvet", "Willow", "Yoyo", "Zephyr", "Acorn", "Basil", "Cinder", "Dumpling", "Ember",
    "Figaro", "Gumbo", "Hopper",
)
FIRST_NAMES = (
    "Alice", "Bruno", "Clara", "Dmitri", "Elena", "Farid", "Greta", "Hugo", "Ines", "Jonas",
    "Kira", "Liam", "Mira", "Nadia", "Oscar", "Priya", "Quentin", "Rosa", "Samir", "Tessa",
    "Umar", "Vera", "Walter", "Xenia", "Yusuf", "Zara", "Anton", "Bianca", "Cyrus", "Daria",
    "Emil", "Fiona", "Gideon", "Hana", "Ivan", "Julia", "Kofi", "Lena", "Marco", "Nina",
    "Otto", "Paula", "Rafael", "Sofia", "Tobias", "Ursula", "Viktor", "Wanda", "Yara", "Zoltan",
    "Amara", "Boris", "Celine", "Diego", "Esme", "Felix", "Gloria", "Henrik", "Iris", "Jakob",
)
LAST_NAMES = (
    "Abbott", "Brennan", "Castillo", "Dufresne", "Eriksen", "Fontaine", "Galloway", "Hartley",
    "Ishikawa", "Jansen", "Kowalski", "Lindqvist", "Moreau", "Novak", "Okafor", "Petrov",
    "Quigley", "Rossi", "Sandoval", "Thornton", "Umberto", "Varga", "Whitlock", "Yilmaz",
    "Zeller", "Ashworth", "Bellamy", "Crane", "Delacroix", "Everly", "Fairbanks", "Grimshaw",
    "Holloway", "Iverson", "Jarvis", "Kessler", "Lockwood", "Mercer", "Nakamura", "Oakley",
)
RELATIONS = ("sister", "brother", "cousin", "neighbour", "friend", "aunt", "uncle", "boss",
             "teacher", "dentist")
CITIES = (
    "Lisbon", "Oslo", "Kyoto", "Lima", "Cairo", "Dublin", "Quebec", "Nairobi", "Hanoi", "Porto",
    "Krakow", "Tbilisi", "Seville", "Bergen", "Bruges", "Tallinn", "Cusco", "Zagreb", "Leeds",
    "Perth", "Austin", "Denver", "Geneva", "Malmo", "Turin", "Utrecht", "Valencia", "Windhoek",
    "Yerevan", "Zurich", "Accra", "Bilbao", "Cordoba", "Dakar", "Essen", "Florence", "Ghent",
    "Helsinki", "Izmir", "Jaipur",
)
COLOURS = ("red", "blue", "green", "yellow", "purple", "orange", "teal", "silver", "gold",
           "maroon", "navy", "olive", "pink", "turquoise", "crimson", "amber", "lilac", "coral",
           "beige", "indigo")
FOODS = ("pizza", "sushi", "lasagne", "curry", "pancakes", "risotto", "tacos", "dumplings",
         "paella", "ramen", "falafel", "goulash", "burritos", "noodles", "omelettes", "waffles",
         "couscous", "pierogi", "kebabs", "nachos", "porridge", "gnocchi", "stew", "salad")
JOBS = ("baker", "nurse", "pilot", "teacher", "carpenter", "plumber", "lawyer", "chemist",
        "painter", "farmer", "librarian", "dentist", "surgeon", "tailor", "jeweller",
        "gardener", "butcher", "translator", "locksmith", "potter", "sailor", "courier",
        "welder", "brewer", "cartographer")
INSTRUMENTS = ("piano", "violin", "cello", "flute", "guitar", "trumpet", "harp", "drums",
               "clarinet", "banjo", "oboe", "accordion", "saxophone", "ukulele", "trombone")
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December")
NEEDLE_KEYS = (
    "ORCHID", "TULIP", "MAPLE", "FALCON", "GRANITE", "COBALT", "LANTERN", "MERIDIAN", "NEBULA",
    "OSPREY", "PRISM", "QUARTZ", "RAVEN", "SAPPHIRE", "TUNDRA", "UMBRA", "VORTEX", "WILLOW",
    "ZENITH", "AURORA", "BEACON", "CANYON", "DELTA", "EMBER", "FJORD", "GLACIER", "HARBOR",
    "IVORY", "JASMINE", "KESTREL", "LOTUS", "MAGNET", "NECTAR", "ONYX", "PHOENIX", "QUASAR",
    "RIDGE", "SIERRA", "TOPAZ", "VIOLET",
)
TOWNS = (
    "Brindlemoor", "Ashcombe", "Caldervale", "Dunhollow", "Elderwick", "Fennimore", "Glenhaven",
    "Hollowmere", "Ivybridge", "Kestrelford", "Larkspur", "Mistlecombe", "Northwold",
    "Oakhurst", "Pennyrock", "Quillfield", "Ravensbrook", "Saltmarsh", "Thistledown",
    "Underby", "Valemont", "Westerhold", "Yarrowby", "Zennorth", "Amberlea", "Briarwood",
    "Coldspring", "Driftwell", "Emberton", "Foxmere",
)
RIVERS = ("Avon", "Tarn", "Wend", "Lowe", "Isel", "Corra", "Mersa", "Halde", "Brisk", "Oren",
          "Selby", "Farrow", "Kell", "Dunmore", "Ystra", "Pellin")
PRODUCTS = ("cheese", "glass", "clocks", "lace", "cider", "pottery", "wool", "honey", "rope",
            "violins", "lanterns", "bells", "paper", "soap", "candles", "saddles", "maps",
            "kites", "barrels", "tiles")
SMALL_TALK = (
    ("How are you today?", "I am doing well, thank you."),
    ("Nice weather today, isn't it?", "It sounds lovely."),
    ("Can you help me with something?", "Of course, go ahead."),
    ("I had a long day at work.", "I am sorry to hear that. I hope you can rest now."),
    ("Thanks for listening.", "You are welcome."),
    ("Do you like music?", "I enjoy talking about music."),
)
ACKS = ("Got it.", "Noted.", "Okay, I will remember that.", "Thanks for telling me.",
        "Understood.", "I have noted that.")
READ_ACKS = ("I have read it.", "Okay, I read the text.", "Done, ask me anything about it.")
ECHO_PREFIXES = ("To confirm:", "Let me repeat that:", "Noted:")
# Share of statements the assistant acknowledges by repeating them verbatim. Verbatim repeats are
# dense copy-from-context events; they teach tiny models induction-style copying far faster than
# the sparse question/answer events alone.
ECHO_RATE = 1.0

AGE_RANGE = (2, 15)
FLAT_RANGE = (10, 99)
YEAR_RANGE = (1650, 1949)
CODE_RANGE = (1000, 9999)
SUFFIX_RANGE = (10, 99)

# Candidate pools an answer may come from, for chance estimates: name -> (size, membership test).
_WORD_POOLS = {
    "pet_name": PET_NAMES, "first_name": FIRST_NAMES, "city": CITIES, "colour": COLOURS,
    "food": FOODS, "job": JOBS, "instrument": INSTRUMENTS, "day": DAYS, "month": MONTHS,
    "town": TOWNS, "river": RIVERS, "product": PRODUCTS,
}
_NUMBER_POOLS = {"age": AGE_RANGE, "flat": FLAT_RANGE, "year": YEAR_RANGE, "code": CODE_RANGE}


@dataclass(frozen=True)
class EvalItem:
    """One held-out recall item: ``messages`` end with a user question whose answer is ``answer``."""

    kind: str
    messages: list[dict]
    answer: str


@dataclass(frozen=True)
class HandoffConversation:
    """A multi-turn hand-off conversation: topics stated up front, then one question per turn.

    ``opening`` holds the statement exchanges (user statement, assistant acknowledgement);
    ``questions`` holds (question, gold answer without its final period) pairs, all distinct.
    """

    opening: list[dict]
    questions: list[tuple[str, str]]


@dataclass
class _Topic:
    """Something the user tells the assistant, plus the questions it makes answerable."""

    kind: str
    statement: str
    ack: str
    questions: list[tuple[str, str]]


# --- Seeds --------------------------------------------------------------------------------------


def item_seed(stream: int, seed: int, index: int) -> int:
    """The per-conversation seed: stream in bits 32-33, user seed above, index below.

    Distinct ``(stream, seed, index)`` triples always give distinct seeds, so the streams never
    share an item seed whatever seeds the callers pick.
    """
    if stream not in _STREAMS:
        raise ValueError(f"unknown stream {stream!r}")
    if not 0 <= index < 2**_INDEX_BITS:
        raise ValueError(f"index {index} out of range")
    if seed < 0:
        raise ValueError(f"seed must be non-negative, got {seed}")
    return (seed << (_INDEX_BITS + _STREAM_BITS)) | (stream << _INDEX_BITS) | index


# --- Topic builders -----------------------------------------------------------------------------


def _fact_topic(rng: random.Random) -> _Topic:
    """Two or three personal facts of distinct types; same-type facts act as distractors."""
    builders = [_pet_facts, _relative_facts, _favourite_facts, _job_fact, _music_facts,
                _flat_fact, _birthday_fact]
    chosen = rng.sample(builders, rng.randint(2, 3))
    sentences: list[str] = []
    questions: list[tuple[str, str]] = []
    for build in chosen:
        said, asked = build(rng)
        sentences.extend(said)
        questions.extend(asked)
    rng.shuffle(sentences)
    text = " ".join(sentences)
    return _Topic("fact", text, _ack(rng, ACKS, text), questions)


def _pet_facts(rng: random.Random) -> tuple[list[str], list[tuple[str, str]]]:
    """One or two pets of different kinds (the second is a distractor for the first)."""
    kinds = rng.sample(PET_KINDS, rng.randint(1, 2))
    names = rng.sample(PET_NAMES, len(kinds))
    said, asked = [], []
    for kind, name in zip(kinds, names):
        age = str(rng.randint(*AGE_RANGE))
        pron = rng.choice(("she", "he"))
        said.append(f"My {kind} is called {name}, and {pron} is {age}.")
        asked.append((f"What is my {kind} called?", name))
        asked.append((f"How old is my {kind}?", age))
    return said, asked


def _relative_facts(rng: random.Random) -> tuple[list[str], list[tuple[str, str]]]:
    """One or two people with the city they live in."""
    relations = rng.sample(RELATIONS, rng.randint(1, 2))
    people = rng.sample(FIRST_NAMES, len(relations))
    cities = rng.sample(CITIES, len(relations))
    said, asked = [], []
    for relation, person, city in zip(relations, people, cities):
        said.append(f"My {relation} is {person}, who lives in {city}.")
        asked.append((f"Where does my {relation} live?", city))
        asked.append((f"What is my {relation}'s name?", person))
    return said, asked


def _favourite_facts(rng: random.Random) -> tuple[list[str], list[tuple[str, str]]]:
    """A favourite colour and/or food."""
    said, asked = [], []
    if rng.random() < 0.7:
        colour = rng.choice(COLOURS)
        said.append(f"My favourite colour is {colour}.")
        asked.append(("What is my favourite colour?", colour))
    if not said or rng.random() < 0.5:
        food = rng.choice(FOODS)
        said.append(f"My favourite food is {food}.")
        asked.append(("What is my favourite food?", food))
    return said, asked


def _job_fact(rng: random.Random) -> tuple[list[str], list[tuple[str, str]]]:
    """The user's job."""
    job = rng.choice(JOBS)
    return [f"I work as a {job}."], [("What do I work as?", job)]


def _music_facts(rng: random.Random) -> tuple[list[str], list[tuple[str, str]]]:
    """An instrument and the day it is practised."""
    instrument, day = rng.choice(INSTRUMENTS), rng.choice(DAYS)
    said = [f"Every {day}, I play the {instrument}."]
    asked = [("What instrument do I play?", instrument), ("On which day do I play music?", day)]
    return said, asked


def _flat_fact(rng: random.Random) -> tuple[list[str], list[tuple[str, str]]]:
    """A flat number (a short number to copy)."""
    flat = str(rng.randint(*FLAT_RANGE))
    return [f"My flat number is {flat}."], [("What is my flat number?", flat)]


def _birthday_fact(rng: random.Random) -> tuple[list[str], list[tuple[str, str]]]:
    """A birthday month."""
    month = rng.choice(MONTHS)
    return [f"My birthday is in {month}."], [("In which month is my birthday?", month)]


def _needle_topic(rng: random.Random) -> _Topic:
    """Two to four codes under distinct keys; every one can be asked, the rest are distractors."""
    count = rng.randint(2, 4)
    keys = [f"{word}-{rng.randint(*SUFFIX_RANGE)}" for word in rng.sample(NEEDLE_KEYS, count)]
    codes = [str(rng.randint(*CODE_RANGE)) for _ in keys]
    lines = [f"The code for {key} is {code}." for key, code in zip(keys, codes)]
    opener = rng.choice(("Remember:", "Please remember these codes.", "Keep these safe."))
    questions = [(f"What is the code for {key}?", code) for key, code in zip(keys, codes)]
    text = " ".join(lines)
    return _Topic("needle", f"{opener} {text}", _ack(rng, ACKS, text), questions)


def _qa_topic(rng: random.Random) -> _Topic:
    """A short paragraph about a fictional town or person, with span questions."""
    build = _town_paragraph if rng.random() < 0.5 else _person_paragraph
    paragraph, questions = build(rng)
    intro = rng.choice(("Read this:", "Here is a short text.", "Please read the following."))
    return _Topic("qa", f"{intro} {paragraph}", _ack(rng, READ_ACKS, paragraph), questions)


def _town_paragraph(rng: random.Random) -> tuple[str, list[tuple[str, str]]]:
    """A fictional town: river, founder, year and product."""
    town, river, product = rng.choice(TOWNS), rng.choice(RIVERS), rng.choice(PRODUCTS)
    founder = f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"
    year = str(rng.randint(*YEAR_RANGE))
    text = (f"{town} is a small town on the river {river}. In {year}, it was founded by "
            f"{founder}. Today the town is known for its {product}.")
    questions = [
        (f"Which river is {town} on?", river),
        (f"Who founded {town}?", founder),
        (f"In which year was {town} founded?", year),
        (f"What is {town} known for?", product),
    ]
    return text, questions


def _person_paragraph(rng: random.Random) -> tuple[str, list[tuple[str, str]]]:
    """A fictional person: job, town, pet and instrument."""
    first, last = rng.choice(FIRST_NAMES), rng.choice(LAST_NAMES)
    job, town, instrument = rng.choice(JOBS), rng.choice(TOWNS), rng.choice(INSTRUMENTS)
    kind, pet = rng.choice(PET_KINDS), rng.choice(PET_NAMES)
    pron = rng.choice(("She", "He"))
    text = (f"{first} {last} works as a {job}, and lives in {town}. {pron} plays the "
            f"{instrument}, and has a {kind} called {pet}.")
    questions = [
        (f"Where does {first} live?", town),
        (f"What is {first}'s job?", job),
        (f"Which instrument does {first} play?", instrument),
        (f"What is the name of {first}'s {kind}?", pet),
    ]
    return text, questions


def _ack(rng: random.Random, plain: Sequence[str], echoed: str) -> str:
    """The assistant's acknowledgement: a stock phrase, or a verbatim repeat of ``echoed``."""
    if rng.random() < ECHO_RATE:
        return f"{rng.choice(ECHO_PREFIXES)} {echoed}"
    return rng.choice(plain)


_TOPIC_BUILDERS = {"fact": _fact_topic, "needle": _needle_topic, "qa": _qa_topic}


# --- Conversations ------------------------------------------------------------------------------


def _conversation(rng: random.Random, final_kind: str | None = None) -> tuple[list[dict], str]:
    """One conversation of 2-4 exchanges, ending with a question; returns (messages, final kind).

    One or two topics are stated first (each in its own exchange), then questions drawn from all
    stated topics fill the remaining exchanges. ``final_kind`` forces the kind of the last question.
    """
    # Weighted towards longer conversations: more questions per token means more retrieval events.
    n_exchanges = rng.choices((2, 3, 4), weights=(1, 2, 3))[0]
    kinds = [final_kind or rng.choice(KINDS)]
    if n_exchanges >= 3 and rng.random() < 0.5:
        # A second topic of another kind: two topics of one kind could contradict each other.
        kinds.append(rng.choice([k for k in KINDS if k != kinds[0]]))
        rng.shuffle(kinds)
    topics = [_TOPIC_BUILDERS[kind](rng) for kind in kinds]
    messages: list[dict] = []
    for topic in topics:
        messages += [_msg("user", topic.statement), _msg("assistant", topic.ack)]
    n_questions = n_exchanges - len(topics)
    # Occasional small talk between statements and questions puts distance between fact and query.
    if n_questions >= 2 and rng.random() < 0.3:
        said, reply = rng.choice(SMALL_TALK)
        messages += [_msg("user", said), _msg("assistant", reply)]
        n_questions -= 1
    asked = _pick_questions(rng, topics, n_questions, final_kind)
    for question, answer in asked:
        messages += [_msg("user", question), _msg("assistant", f"{answer}.")]
    last_kind = next(t.kind for t in topics if asked[-1] in t.questions)
    return messages, last_kind


def _pick_questions(rng: random.Random, topics: list[_Topic], count: int,
                    final_kind: str | None) -> list[tuple[str, str]]:
    """``count`` distinct questions from the topics; the last one from ``final_kind`` if given."""
    pool = [q for t in topics for q in t.questions]
    asked = rng.sample(pool, min(count, len(pool)))
    if final_kind is not None:
        wanted = [q for t in topics if t.kind == final_kind for q in t.questions]
        if asked[-1] not in wanted:
            remaining = [q for q in wanted if q not in asked[:-1]]
            asked[-1] = rng.choice(remaining)
    return asked


def _msg(role: str, content: str) -> dict:
    """A chat message dict."""
    return {"role": role, "content": content}


def _check_count(n: int) -> None:
    """Reject counts that are negative or too large for the item-seed layout."""
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < 2**_INDEX_BITS:
        raise ValueError(f"n must be an int in [0, 2**32), got {n!r}")


def generate_conversations(n: int, seed: int) -> list[list[dict]]:
    """``n`` training conversations (training stream), identical for identical ``(n, seed)``."""
    _check_count(n)
    out = []
    for index in range(n):
        messages, _ = _conversation(random.Random(item_seed(TRAIN_STREAM, seed, index)))
        out.append(messages)
    return out


def recall_hit(gold: str, generated: str) -> bool:
    """A recall answer is correct when the gold answer (final period stripped) occurs in the first line of the
    generated text."""
    return gold.strip().removesuffix(".") in generated.strip().split("\n")[0]


def recall_items(n: int, seed: int) -> list[EvalItem]:
    """``n`` held-out recall items (held-out stream), kinds cycling fact, needle, qa.

    Each item is a conversation cut before its final assistant turn: ``messages`` end with the user
    question and ``answer`` is the assistant reply (e.g. ``"Biscuit."``).
    """
    _check_count(n)
    items = []
    for index in range(n):
        rng = random.Random(item_seed(HELDOUT_STREAM, seed, index))
        messages, kind = _conversation(rng, final_kind=KINDS[index % len(KINDS)])
        items.append(EvalItem(kind=kind, messages=messages[:-1], answer=messages[-1]["content"]))
    return items


def handoff_conversations(n: int, turns: int, seed: int) -> list[HandoffConversation]:
    """``n`` held-out hand-off conversations (hand-off stream) with ``turns`` questions each.

    A short text (qa) and a fact or needle topic are stated first; a topic of the third kind is
    added only when the first two make fewer than ``turns`` distinct questions. Keeping the
    opening short keeps whole conversations near the lengths the embedded models trained on.

    Raises:
        ValueError: ``turns`` outside [1, MAX_HANDOFF_TURNS], or a bad ``n``.
    """
    _check_count(n)
    if not 1 <= turns <= MAX_HANDOFF_TURNS:
        raise ValueError(f"turns must be between 1 and {MAX_HANDOFF_TURNS}, got {turns!r}")
    out = []
    for index in range(n):
        rng = random.Random(item_seed(HANDOFF_STREAM, seed, index))
        topics = _handoff_topics(rng, turns)
        opening = [m for t in topics for m in (_msg("user", t.statement), _msg("assistant", t.ack))]
        pool = [(q, a) for t in topics for q, a in t.questions]
        out.append(HandoffConversation(opening, rng.sample(pool, turns)))
    return out


def _handoff_topics(rng: random.Random, turns: int) -> list[_Topic]:
    """qa plus fact or needle (plus the third kind if needed), redrawn until ``turns`` questions exist.

    Three topics always make at least 8 questions and usually far more, so the loop ends quickly
    for every allowed ``turns``.
    """
    while True:
        second = rng.choice(("fact", "needle"))
        kinds = ["qa", second]
        topics = [_TOPIC_BUILDERS[kind](rng) for kind in kinds]
        if sum(len(t.questions) for t in topics) < turns:
            third = "needle" if second == "fact" else "fact"
            topics.append(_TOPIC_BUILDERS[third](rng))
        if sum(len(t.questions) for t in topics) >= turns:
            rng.shuffle(topics)
            return topics


def answer_chance(answer: str) -> float:
    """Probability of guessing ``answer`` uniformly from the pool it was drawn from.

    Conservative: when the value could come from several pools, the smallest pool (highest
    chance) counts. Founders are first+last name pairs. Unknown values count as chance 1.
    """
    value = answer.strip().removesuffix(".")
    sizes = [len(pool) for pool in _WORD_POOLS.values() if value in pool]
    if value.isdigit():
        sizes += [hi - lo + 1 for lo, hi in _NUMBER_POOLS.values() if lo <= int(value) <= hi]
    first, _, last = value.partition(" ")
    if first in FIRST_NAMES and last in LAST_NAMES:
        sizes.append(len(FIRST_NAMES) * len(LAST_NAMES))
    return 1.0 / min(sizes) if sizes else 1.0
