"""Generator of the shipped English corpus ``moe_train/assets/corpus.txt``.

The smoke test trains a byte-level model on real-looking English prose. So that the kit owns every
sentence it ships, the text is generated here, deterministically (``random.Random(SEED)``, stdlib
only), from a small phrase-structure grammar: shared sentence patterns (narration, description,
cause and effect, reported speech, instructions, dialogue) filled from per-topic word lists
(weather, cooking, trains, a cluster of machines, experts routing tokens, gardens, ...). The word
lists and sentence templates live in ``moe_train/assets/corpus_topics.toml``; this module holds the
code that expands them.

    python -m moe_train.data.corpus            # (re)write moe_train/assets/corpus.txt
    python -m moe_train.data.corpus --check    # exit 1 if the shipped file differs from the generator
    python -m moe_train.data.corpus --out PATH # write elsewhere
"""

from __future__ import annotations

import argparse
import bisect
import random
import re
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

SEED = 20240611
TARGET_BYTES = 420_000
ASSETS = Path(__file__).resolve().parents[1] / "assets"  # moe_train/assets
DEFAULT_OUT = ASSETS / "corpus.txt"
DATA_FILE = ASSETS / "corpus_topics.toml"

# ---------------------------------------------------------------------------------------------
# Morphology


def _ending(word: str, ending: str, after_y: str) -> str:
    """``word`` + ``ending``, or a final consonant + y replaced by ``after_y`` (cries, cried)."""
    if re.search(r"[^aeiou]y$", word):
        return word[:-1] + after_y
    return word + ending


def _add_s(word: str, sibilant: str = r"(s|x|z|ch|sh)$") -> str:
    if re.search(sibilant, word):
        return word + "es"
    return _ending(word, "s", "ies")


def plural(noun: str) -> str:
    return noun.split("/", 1)[1] if "/" in noun else _add_s(noun)


def singular(noun: str) -> str:
    return noun.split("/", 1)[0]


_AN_EXCEPT = ("uni", "use", "usu", "one", "eur")
_AN_EXTRA = ("hour", "honest")


def article(phrase: str) -> str:
    low = phrase.lower()
    vowel = low[:1] in "aeiou" and not low.startswith(_AN_EXCEPT)
    if vowel or low.startswith(_AN_EXTRA):
        return "an " + phrase
    return "a " + phrase


def verb_form(spec: str, form: str) -> str:
    """``spec`` is ``base`` or ``base/past``; form is base | s | past."""
    base, _, past = spec.partition("/")
    if form == "base":
        return base
    if form != "past":
        return "has" if base == "have" else _add_s(base, r"(s|x|z|ch|sh|o)$")
    if past:
        return past
    if base.endswith("e"):
        return base + "d"
    return _ending(base, "ed", "ied")


def conjugate(text: str, form: str) -> str:
    """Conjugate every ``<base/past>`` marker in ``text``."""
    return re.sub(r"<([^<>]+)>", lambda m: verb_form(m.group(1), form), text)


def capitalize(s: str) -> str:
    for i, ch in enumerate(s):
        if ch.isalpha():
            return s[:i] + ch.upper() + s[i + 1 :]
    return s


# ---------------------------------------------------------------------------------------------
# Data: shared vocabulary, grammar tables and topics, all in corpus_topics.toml (see its header).

_DATA = tomllib.loads(DATA_FILE.read_text(encoding="utf-8"))
V = SimpleNamespace(**{k: tuple(v) for k, v in _DATA["vocab"].items()})  # shared vocabulary
G = SimpleNamespace(**_DATA["grammar"])  # grammar tables
TOPICS: dict[str, dict] = _DATA["topics"]  # in file order
TOPIC_NAMES = tuple(TOPICS)
PARAGRAPH_KEYS = ("act", "event", "fact", "line", "answer")

# ---------------------------------------------------------------------------------------------
# Grammar

# What each {slot} of a template expands to, for a Writer ``w`` (``w.tense``: the sentence's).
SLOTS = {
    "thing": lambda w: singular(w.pick(w.t["things"], "thing")),
    "things": lambda w: plural(w.pick(w.t["things"], "thing")),
    "a_thing": lambda w: article(singular(w.pick(w.t["things"], "thing"))),
    "stuff": lambda w: w.pick(w.t["stuff"], "stuff"),
    "adj": lambda w: w.pick(w.t["adjs"], "adj"),
    "person": lambda w: "the " + w.pick(w.t["people"], "person"),
    "people": lambda w: plural(w.pick(w.t["people"], "person")),
    "place": lambda w: w.fill(w.pick(w.t["places"], "place")),
    "unit": lambda w: w.fill(w.pick(w.t["units"])),
    "line": lambda w: w.fill(w.pick(w.t["lines"], "line")),
    "name": lambda w: w.pick(V.names, "name"),
    "our": lambda w: w.rng.choice(("my", "our")),
    "relative": lambda w: w.pick(V.family, "family"),
    "n": lambda w: str(w.rng.randint(2, 40)),
    "few": lambda w: w.rng.choice(V.number_words[:8]),
    "big": lambda w: f"{w.rng.choice(V.big_numbers):,}",
    "pct": lambda w: str(w.rng.randrange(5, 100, 5)),
    "clock": lambda w: f"{w.rng.randint(1, 12)}:{w.rng.choice(V.minutes)}",
    "day": lambda w: w.rng.choice(V.days),
    "month": lambda w: w.pick(V.months, "month"),
    "dir": lambda w: w.rng.choice(V.directions),
    "adverb": lambda w: w.rng.choice(V.adverbs),
    "contrast": lambda w: w.rng.choice(V.contrasts),
    "duration": lambda w: w.fill(w.rng.choice(V.durations)),
    "be": lambda w: w.be("3s", w.tense),
    "are": lambda w: w.be("pl", w.tense),
    "took": lambda w: conjugate("<take/took>", w.form("3s", w.tense)),
    "time": lambda w: w.time(w.tense),
    "event": lambda w: w.event(w.tense),
    "clause": lambda w: w.clause(w.tense),
    "event_now": lambda w: w.event("present"),
    "event_past": lambda w: w.event("past"),
    "vp": lambda w: w.vp(),
    "utterance": lambda w: w.utterance(),
}


class Writer:
    """Expands sentence patterns for one topic with one random stream."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.t: dict = {}  # the topic
        self.tense = "past"  # of the sentence being written
        self.used: dict[str, set] = {}  # per sentence
        self.para: dict[str, set] = {}  # per paragraph

    # -- picks and templates -------------------------------------------------------------------
    def pick(self, seq, key: str | None = None):
        """A random element; with a key, avoids repeating one already used in this sentence
        (or, for whole clauses, in this paragraph)."""
        store = self.para if key in PARAGRAPH_KEYS else self.used
        seen = store.setdefault(key, set()) if key else None
        for _ in range(6):
            x = self.rng.choice(seq)
            if seen is None or x not in seen:
                break
        if seen is not None:
            seen.add(x)
        return x

    def slot(self, name: str) -> str:
        return SLOTS[name](self)

    def fill(self, template: str, **given: str) -> str:
        """Expand the {slots} of ``template`` left to right; ``given`` ones are not drawn."""

        def one(m: re.Match) -> str:
            return given[m.group(1)] if m.group(1) in given else self.slot(m.group(1))

        return re.sub(r"\{(\w+)\}", one, template)

    def band(self, table: dict) -> int:
        """Index of the band of ``table["cuts"]`` that one fresh random number falls in."""
        return bisect.bisect_right(table["cuts"], self.rng.random())

    def expand(self, table: dict, band: int | None = None, **given: str) -> str:
        """Fill the template of a banded table (the band drawn here when None)."""
        band = self.band(table) if band is None else band
        return self.fill(table["templates"][band], **given)

    # -- phrases -------------------------------------------------------------------------------
    def subject(self, allow_pronoun: bool = True) -> tuple[str, str]:
        """A subject and its person: '1s' (I), '3s', or 'pl'."""
        band = self.band(G.subject)
        if band < len(G.subject["persons"]):
            return self.expand(G.subject, band), G.subject["persons"][band]
        if not allow_pronoun:
            return self.slot("name"), "3s"
        return tuple(self.rng.choice(G.subject["pronouns"]))

    @staticmethod
    def form(person: str, tense: str) -> str:
        return "past" if tense == "past" else ("s" if person == "3s" else "base")

    @staticmethod
    def be(person: str, tense: str) -> str:
        if tense == "past":
            return "were" if person == "pl" else "was"
        return {"1s": "am", "3s": "is", "pl": "are"}[person]

    def vp(self, form: str = "base") -> str:
        return conjugate(self.fill(self.pick(self.t["acts"], "act")), form)

    def event(self, tense: str) -> str:
        subj, _, rest = self.pick(self.t["events"], "event").partition("|")
        person = "pl" if subj.endswith("+") else "3s"
        subj = self.fill(subj.rstrip("+"))
        return f"{subj} {conjugate(self.fill(rest), self.form(person, tense))}"

    def clause(self, tense: str) -> str:
        if self.rng.random() < 0.45:
            return self.event(tense)
        subj, person = self.subject()
        return f"{subj} {self.vp(self.form(person, tense))}"

    def time(self, tense: str) -> str:
        return self.fill(self.rng.choice(V.past_times if tense == "past" else V.present_times))

    # -- sentences (the kinds and their weights are in [grammar]) ------------------------------
    def sentence(self, tense: str) -> str:
        self.used, self.tense = {}, tense
        kind = self.rng.choices(G.sentence_kinds, weights=G.sentence_weights)[0]
        method = getattr(self, "s_" + kind, None)  # the kinds without one are plain tables
        return capitalize(method(tense) if method else self.expand(getattr(G, kind)))

    def s_action(self, tense: str) -> str:
        subj, person = self.subject()
        return self.expand(G.action, s=f"{subj} {self.vp(self.form(person, tense))}")

    def s_event(self, tense: str) -> str:
        return self.expand(G.event, s=self.event(tense))

    def s_describe(self, tense: str) -> str:
        band, given = self.band(G.describe), {}
        if band == 3:
            given["degree"] = self.rng.choice(G.degrees)
        elif band == 4:
            given["day_part"] = self.rng.choice(G.day_parts)
            given["a_day_adj"] = article(self.rng.choice(V.day_adjs))
        return self.expand(G.describe, band, **given)

    def s_complex(self, tense: str) -> str:
        band = self.band(G.complex)
        a, b = self.clause(tense), self.clause(tense)
        return self.expand(G.complex, band, a=a, b=b)

    def s_report(self, tense: str) -> str:
        subj, person = self.subject(allow_pronoun=self.rng.random() < 0.5)
        verb = conjugate(self.rng.choice(V.report_verbs), self.form(person, tense))
        return self.expand(G.report, s=f"{subj} {verb} that {self.clause(tense)}")

    def s_modal(self, tense: str) -> str:
        subj, person = self.subject()
        if self.rng.random() < 0.55:
            cat = conjugate(self.rng.choice(V.catenatives), self.form(person, tense))
            return f"{subj} {cat} {self.vp()}."
        if tense != "past":
            modal = self.rng.choice(G.present_modals)
            modal = "does not" if modal == "do not" and person == "3s" else modal
            return f"{subj} {modal} {self.vp()}."
        modal = self.rng.choice(G.past_modals)
        when = f" {self.time(tense).lower()}" if self.rng.random() < 0.3 else ""
        return f"{subj} {modal} {self.vp()}{when}."

    def s_fact(self, tense: str) -> str:
        return self.fill(self.pick(self.t["facts"], "fact"))

    def s_list(self, tense: str) -> str:
        rest = [article(self.slot("thing")), f"some {self.slot('stuff')}"]
        self.rng.shuffle(rest)
        items = [f"{self.slot('few')} {self.slot('things')}"] + rest
        place = capitalize(self.slot("place"))
        return f"{place} there {self.be('pl', tense)} {items[0]}, {items[1]}, and {items[2]}."

    def s_feeling(self, tense: str) -> str:
        subj, person = self.subject(allow_pronoun=False)
        feel = self.rng.choice(V.feelings)
        felt = conjugate("<feel/felt>", self.form(person, tense))
        return self.expand(G.feeling, subj=subj, be=self.be(person, tense), felt=felt, feel=feel)

    def s_measure(self, tense: str) -> str:
        band, given = self.band(G.measure), {}
        if band == 1:
            subj, person = self.subject(allow_pronoun=False)
            given["counted"] = f"{subj} {conjugate('<count/counted>', self.form(person, tense))}"
        return self.expand(G.measure, band, **given)

    # -- paragraphs ----------------------------------------------------------------------------
    def paragraph(self) -> str:
        r = self.rng.random()
        if r < 0.12:
            return self.instructions()
        tense = "past" if r < 0.62 else "present"
        n = self.rng.randint(3, 7)
        self.used, self.para = {}, {}
        sents = [capitalize(f"{self.time(tense)}, {self.clause(tense)}.")]
        sents += [self.sentence(tense) for _ in range(n - 1)]
        return " ".join(sents)

    def instructions(self) -> str:
        self.used, self.para = {}, {}
        opener = self.rng.choice(G.openers)
        order = G.steps[: self.rng.randint(2, 4)] + ["Finally"]
        sents = [self.fill(opener)]
        for step in order:
            extra = self.expand(G.step)
            sents.append(f"{step}, {self.vp()}{extra}.")
        if self.rng.random() < 0.5:
            sents.append(capitalize(f"if {self.event('present')}, {self.vp()}."))
        return " ".join(sents)

    def utterance(self) -> str:
        band = self.band(G.utterance)
        self.used = {}
        return capitalize(self.expand(G.utterance, band))

    def dialogue(self) -> list[str]:
        a, b = self.rng.sample(V.names, 2)
        self.para = {}
        lines, asked = [], False
        for i in range(self.rng.randint(2, 5)):
            answer = asked and self.rng.random() < 0.6
            u = self.fill(self.pick(V.answers, "answer")) if answer else self.utterance()
            asked = u.endswith("?")
            lines.append(self.quote(u, (a, b)[i % 2]))
        return lines

    def quote(self, u: str, who: str) -> str:
        band = self.band(G.quote)
        verb = "asked" if u.endswith("?") else self.rng.choice(V.speech_verbs)
        body = u if u.endswith(("?", "!")) else u[:-1] + ","
        return self.expand(G.quote, band, u=u, who=who, verb=verb, body=body)


def generate(target_bytes: int = TARGET_BYTES, seed: int = SEED) -> str:
    """The corpus text: sections of titled paragraphs and dialogue, about ``target_bytes`` long."""
    rng = random.Random(seed)
    w = Writer(rng)
    blocks: list[str] = []
    size = 0
    while size < target_bytes:
        w.t, w.used = TOPICS[rng.choice(TOPIC_NAMES)], {}
        part = [w.fill(rng.choice(w.t["titles"]))]
        for _ in range(rng.randint(2, 6)):
            part += w.dialogue() if rng.random() < 0.25 else [w.paragraph()]
        blocks.append("\n\n".join(part))
        size += len(blocks[-1].encode()) + 3
    return "\n\n\n".join(blocks) + "\n"


def check(path: Path = DEFAULT_OUT) -> bool:
    """True when ``path`` holds exactly what :func:`generate` produces."""
    try:
        return path.read_bytes() == generate().encode("utf-8")
    except FileNotFoundError:
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m moe_train.data.corpus", description=(__doc__ or "").partition("\n")[0]
    )
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output file (default {DEFAULT_OUT})")
    ap.add_argument(
        "--check",
        action="store_true",
        help="do not write; exit 1 if the file differs from the generator's output",
    )
    args = ap.parse_args(argv)
    if args.check:
        ok = check(args.out)
        msg = "up to date" if ok else "differs from the generator; run python -m moe_train.data.corpus"
        print(f"{args.out}: {msg}", file=sys.stdout if ok else sys.stderr)
        return 0 if ok else 1
    data = generate().encode("utf-8")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(data)
    print(f"wrote {args.out} ({len(data):,} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
