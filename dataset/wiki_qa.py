"""Question -> answer conversations made from Wikipedia lead summaries.

Every article gives one conversation: a natural question about its title (phrasing picked deterministically
from the title's hash, person-aware and tense-aware) answered by the summary's opening sentences; when the
summary goes on, a follow-up turn ("Tell me more.") is answered by the next sentences. Some articles also
give a one-line "in a few words" conversation answered from the Wikidata short description.
"""

from __future__ import annotations

import hashlib
import re

from dataset.sources import WikiArticle

GENERAL_QUESTIONS = (
    "What is {t}?",
    "Tell me about {t}.",
    "What can you tell me about {t}?",
    "Can you explain {t}?",
    "Give me a short description of {t}.",
    "What do you know about {t}?",
    "Briefly, what is {t}?",
    "I'd like to learn about {t}. What is it?",
    "Explain {t} in a few sentences.",
    "Could you summarize what {t} is?",
    "What should I know about {t}?",
    "{t}: what is that?",
)
PERSON_QUESTIONS = (
    "Who {be} {t}?",
    "Tell me about {t}.",
    "What {be} {t} known for?",
    "Can you tell me who {t} {be}?",
    "Give me a short biography of {t}.",
    "What do you know about {t}?",
    "Who exactly {be} {t}?",
)
FOLLOW_UPS = (
    "Tell me more.",
    "Can you tell me more?",
    "What else should I know about it?",
    "Interesting. Anything else?",
    "Go on.",
    "Could you add some more detail?",
)
SHORT_QUESTIONS = (
    "In a few words, what is {t}?",
    "Describe {t} in one phrase.",
    "What is {t}, in short?",
)

# A period after these words does not end a sentence ("Arthur C. Clarke", "St. Louis", "c. 1500").
_ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof st jr sr vs etc e.g i.e c ca approx no vol fig inc ltd co corp mt ft u.s u.k gen col lt sgt "
    "rev".split()
)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"'(\[]?[A-Z0-9])")

FIRST_ANSWER_CHARS = 200  # answer with whole sentences until at least this many characters
FOLLOW_UP_CHARS = 600  # cap of the follow-up answer (whole sentences)


def _hash(text: str, salt: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{salt}\x00{text}".encode()).digest()[:8], "big")


def split_sentences(text: str) -> list[str]:
    sentences: list[str] = []
    start = 0
    for match in _SENTENCE_END.finditer(text):
        candidate = text[start : match.start()]
        last_word = candidate.rsplit(None, 1)[-1].rstrip(".").lower() if candidate.split() else ""
        # A lone capital ("C.") or a known abbreviation is not a sentence end.
        if last_word in _ABBREVIATIONS or (len(last_word) == 1 and last_word.isalpha()):
            continue
        sentences.append(candidate.strip())
        start = match.end()
    tail = text[start:].strip()
    if tail:
        sentences.append(tail)
    return sentences


def _take(sentences: list[str], min_chars: int, max_chars: int) -> tuple[str, list[str]]:
    """Whole sentences from the front: at least one, stop once ``min_chars`` is reached or ``max_chars``
    would be exceeded. Returns the text and the sentences left."""
    taken: list[str] = []
    length = 0
    for sentence in sentences:
        if taken and (length >= min_chars or length + len(sentence) + 1 > max_chars):
            break
        taken.append(sentence)
        length += len(sentence) + 1
    return " ".join(taken), sentences[len(taken) :]


def _is_past(extract: str) -> bool:
    """Tense of a biography from its first verb after the name ("X was ..." vs "X is ...")."""
    head = extract[:300]
    was, is_ = head.find(" was "), head.find(" is ")
    return was != -1 and (is_ == -1 or was < is_)


def question_for(article: WikiArticle, variant: int = 0) -> str:
    """The question about an article; another `variant` asks it in the next phrasing (distinct phrasings for
    variants below the number of templates: 7 for people, 12 otherwise)."""
    h = _hash(article.title, "question") + variant
    if article.topic == "People":
        be = "was" if _is_past(article.extract) else "is"
        template = PERSON_QUESTIONS[h % len(PERSON_QUESTIONS)]
        return template.format(t=article.title, be=be)
    return GENERAL_QUESTIONS[h % len(GENERAL_QUESTIONS)].format(t=article.title)


def conversations_for(article: WikiArticle) -> list[list[dict[str, str]]]:
    """The QA conversations (as MiniMind ``conversations`` lists) made from one article."""
    sentences = split_sentences(article.extract)
    if not sentences:
        return []
    answer, rest = _take(sentences, FIRST_ANSWER_CHARS, 500)
    messages = [{"role": "user", "content": question_for(article)}, {"role": "assistant", "content": answer}]
    h = _hash(article.title, "follow-up")
    if rest and h % 2 == 0:
        more, _ = _take(rest, FOLLOW_UP_CHARS, FOLLOW_UP_CHARS)
        messages += [
            {"role": "user", "content": FOLLOW_UPS[(h // 2) % len(FOLLOW_UPS)]},
            {"role": "assistant", "content": more},
        ]
    result = [messages]
    description = article.description
    if description and h % 3 == 0 and article.topic != "People":
        short = description[0].upper() + description[1:]
        result.append(
            [
                {"role": "user", "content": SHORT_QUESTIONS[(h // 3) % len(SHORT_QUESTIONS)].format(t=article.title)},
                {"role": "assistant", "content": short.rstrip(".") + "."},
            ]
        )
    return result
