"""Write ``mirrorsd/data/streams/chat_prompts.jsonl``: more chat prompts of ours (never Spec-Bench's) whose answers
the streams train on, next to the draft-vocabulary prompts (``mirrorsd/data/draft_vocab/prompts.jsonl``).

Templates crossed with hand-written topics, German sentences written for this file, arithmetic word problems with
seeded numbers, and summarize / answer-from-context prompts over stdlib module docstrings (prose none of the other
prompts use). Deterministic: rerunning gives the same file.

    python scripts/make_stream_prompts.py
"""

from __future__ import annotations

import importlib
import json
import random
import re
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "mirrorsd" / "data" / "streams" / "chat_prompts.jsonl"

TOPICS = [
    "a community garden", "remote work", "learning a second language", "a night train across Europe",
    "the first day at a new job", "a rainy weekend", "saving money on groceries", "a small bakery",
    "public libraries", "volunteering at an animal shelter", "a mountain hike", "electric scooters in cities",
    "a family recipe", "moving to a new city", "board game nights", "a school science fair", "urban beekeeping",
    "a lost umbrella", "the history of the bicycle", "a solar eclipse", "running a marathon", "a tiny apartment",
    "street food markets", "a broken laptop before a deadline", "birdwatching", "a museum of old computers",
    "a power outage", "learning to play the guitar", "a road trip with friends", "recycling plastic",
]
WRITING = [
    "Write a short blog post about {t}.", "Write a persuasive paragraph about {t}.",
    "Write a short story about {t}.", "Write a friendly email to a colleague about {t}.",
    "Write a product description inspired by {t}.", "Write a short poem about {t}.",
    "Write a news-style report about {t}.", "Write a diary entry about {t}.",
]
ROLEPLAY = [
    "Pretend you are a tour guide and describe {t} to a group of visitors.",
    "Act as a career coach and give advice to someone worried about {t}.",
    "Imagine you are a journalist interviewing an expert on {t}. Write the first three questions and answers.",
]
QUESTIONS = [
    "Why do stars twinkle?", "How does a pressure cooker cook food faster?", "What causes the phases of the Moon?",
    "How do bees make honey?", "Why do time zones exist?", "How does a credit score work?",
    "What is the difference between a hurricane and a tornado?", "How do noise-cancelling headphones work?",
    "Why does bread go stale?", "How does GPS know where you are?", "What is a stock market index?",
    "How do plants know which way is up?", "Why do cats purr?", "What is the greenhouse effect?",
    "How does a bill become a law in the United States?", "What was the Silk Road?", "How do tides work?",
    "What is the difference between DNA and RNA?", "How are rainbows formed?",
    "Who invented the printing press and why did it matter?", "How does a mortgage work?",
    "Why do onions make people cry?", "How does the heart pump blood?", "What is a black hole?",
    "How do solar panels produce electricity?", "Why is the ocean salty?", "How do fish breathe underwater?",
    "How does a vaccine differ from an antibiotic?", "What is the Pythagorean theorem used for?",
    "Why do some metals rust?", "How do earthquakes happen?", "What is the role of the United Nations?",
    "How does recycling paper work?", "Why do we dream?", "What is machine learning, in simple terms?",
    "How do airplanes fly through turbulence safely?", "What is the difference between a lake and a sea?",
    "How did the Roman Empire fall?", "What does a central bank do?", "How do batteries store energy?",
    "Why are coral reefs important?", "How do antibiotics stop infections?", "What causes thunder?",
    "How does the immune system remember a disease?", "What is the speed of light and how was it measured?",
    "Who was Marie Curie?", "What is the Great Barrier Reef?", "Why do leaves change colour in autumn?",
    "How does a microwave oven heat food?", "What is the difference between an atom and a molecule?",
]
ADVICE = [
    "How can I keep a houseplant alive while travelling for two weeks?",
    "What should I pack for a three-day camping trip?", "How do I prepare for a job interview?",
    "How can I make my morning routine less stressful?", "What is a good way to start saving for retirement?",
    "How do I negotiate a higher salary?", "How can I learn to cook healthy meals on a budget?",
    "What are good habits for keeping a clean desk?", "How do I deal with a noisy neighbour politely?",
    "How can I get better at public speaking?", "What is a good plan for learning to swim as an adult?",
    "How should I organise my study time before an exam?", "How can I reduce my screen time?",
    "How do I choose a good second-hand car?", "What are tips for writing a clear email?",
    "How can I help a friend who is going through a hard time?", "How do I start a vegetable garden?",
    "How can I stay motivated when learning to program?", "What should I check before renting an apartment?",
    "How do I plan a birthday party for a ten-year-old?",
]
COMPARE = [
    ("trains", "planes", "a 600 km trip"), ("renting", "buying a home", "a young couple"),
    ("paper books", "e-readers", "a student"), ("cats", "dogs", "a family with a small flat"),
    ("working at an office", "working from home", "a software developer"),
    ("a gym membership", "running outdoors", "a beginner"), ("tea", "coffee", "someone who works late"),
    ("a laptop", "a desktop computer", "a graphic designer"), ("city life", "country life", "retirees"),
    ("learning alone", "taking a class", "an adult learning Spanish"),
]
LOGIC = [
    "A clock shows 3:40. What is the angle between the hour and minute hands? Explain step by step.",
    "If it takes 5 machines 5 minutes to make 5 widgets, how long do 100 machines take to make 100 widgets?",
    "Three friends split a bill of $84 so that one pays twice as much as each of the other two. Who pays what?",
    "A bat and a ball cost $1.10 together, and the bat costs $1.00 more than the ball. How much is the ball?",
    "Is the statement 'all squares are rectangles' true? Is the converse true? Explain.",
    "You have a 3-litre jug and a 5-litre jug. How can you measure exactly 4 litres of water?",
    "If yesterday was Friday, what day will it be the day after tomorrow?",
    "Which is heavier, a kilogram of feathers or a kilogram of steel? Explain the trick.",
]
CODING = [
    "Write a Python function that checks whether a string is a valid email address.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a Python class for a simple bank account with deposit and withdraw methods.",
    "Write a Python function that counts the words in a text file.",
    "Write a Python function that removes duplicates from a list while keeping the order.",
    "How do I sort a list of dictionaries by a key in Python?",
    "Write a Python function that returns the prime numbers up to n.",
    "Explain what a Python decorator is, with an example.",
    "Write a Python function that flattens a nested list.",
    "How do I handle exceptions when opening a file in Python?",
    "Write a Python function that converts Celsius to Fahrenheit and back.",
    "Write a Python script that prints the ten most common words in a text.",
    "Explain list comprehensions in Python with two examples.",
    "Write a Python function that checks whether two strings are anagrams.",
    "Write a binary search function in Python.",
    "What is the difference between a shallow copy and a deep copy in Python?",
    "Write a Python generator that yields the Fibonacci numbers.",
    "Write a SQL query that counts the orders per month in an orders table.",
    "Write a JavaScript function that deep-clones a plain object.",
    "Explain what recursion is and give a Python example.",
    "Write a Python function that validates a sudoku row.",
    "How do I read a JSON file into a dictionary in Python?",
    "Write a Python function that returns the longest common prefix of a list of strings.",
    "Explain the difference between a process and a thread.",
    "Write a unit test with pytest for a function that adds two numbers.",
    "Write a Python dataclass for a book with a title, an author and a year.",
    "How do I make an HTTP GET request in Python?",
    "Write a Python function that reverses the words in a sentence.",
    "Explain Big-O notation with examples.",
    "Write a Python function that computes the median of a list.",
]
GERMAN = [
    "Die Stadtverwaltung plant, im nächsten Jahr mehr Radwege zu bauen.",
    "Nach dem Sturm waren viele Straßen im Norden des Landes gesperrt.",
    "Die Forscher haben eine neue Methode zur Reinigung von Wasser entwickelt.",
    "Im Sommer kommen jedes Jahr Millionen Touristen an die Küste.",
    "Der Verein feiert in diesem Monat sein hundertjähriges Bestehen.",
    "Die Preise für Lebensmittel sind im letzten Quartal deutlich gestiegen.",
    "Viele Schüler lernen inzwischen mit Tablets statt mit Büchern.",
    "Der Bürgermeister eröffnete am Montag die neue Bibliothek.",
    "Die Mannschaft gewann das Spiel nach einer spannenden Verlängerung.",
    "Wegen Bauarbeiten fahren die Busse am Wochenende nach einem anderen Fahrplan.",
    "Das Museum zeigt ab Dezember eine Ausstellung über alte Landkarten.",
    "Die Firma will bis zum Jahr 2030 klimaneutral werden.",
    "In der Nacht sanken die Temperaturen auf minus zehn Grad.",
    "Die Polizei bittet die Bevölkerung um Hinweise zu dem Unfall.",
    "Ein neues Gesetz soll die Rechte von Mietern stärken.",
    "Die Konferenz wurde wegen des großen Interesses um einen Tag verlängert.",
    "Immer mehr Menschen kaufen regionale Produkte auf dem Wochenmarkt.",
    "Der Flughafen meldete einen neuen Rekord bei den Passagierzahlen.",
    "Die Ärzte raten, im Winter ausreichend Vitamin D aufzunehmen.",
    "Das Orchester spielt am Samstag ein Konzert unter freiem Himmel.",
    "Die Regierung und die Gewerkschaften haben sich auf einen Kompromiss geeinigt.",
    "Nach zwei Jahren Bauzeit ist die Brücke endlich fertig.",
    "Die Studie zeigt, dass regelmäßige Bewegung das Gedächtnis verbessert.",
    "Im Zoo wurde ein kleiner Elefant geboren.",
    "Die Universität bietet ab Herbst einen neuen Studiengang für Datenwissenschaft an.",
    "Wegen des Streiks fielen am Dienstag zahlreiche Flüge aus.",
    "Die Bauern hoffen nach dem trockenen Sommer auf mehr Regen.",
    "Der Autor stellte sein neues Buch in einer ausverkauften Lesung vor.",
    "Das Unternehmen hat im vergangenen Jahr zweihundert neue Mitarbeiter eingestellt.",
    "Die Feuerwehr konnte den Brand in der Lagerhalle schnell löschen.",
    "Viele Eltern wünschen sich längere Öffnungszeiten der Kindergärten.",
    "Der Fluss trat nach tagelangem Regen über die Ufer.",
    "Die Ministerin besuchte am Donnerstag mehrere Schulen in der Region.",
    "Ein Großteil des Stroms stammt inzwischen aus erneuerbaren Energien.",
    "Die Ausstellung zieht Besucher aus ganz Europa an.",
    "Der Bahnhof wird in den kommenden drei Jahren vollständig renoviert.",
    "Die Verhandlungen über den neuen Vertrag dauern weiter an.",
    "Am Sonntag findet in der Innenstadt ein großer Flohmarkt statt.",
    "Die Wissenschaftler beobachteten das seltene Naturereignis mit Teleskopen.",
    "Der Spieler erzielte in der letzten Minute das entscheidende Tor.",
]
NAMES = ["Anna", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Keiko", "Liam"]
MATH = [
    "{a} buys {b} notebooks at ${c} each and pays with a ${d} bill. How much change does {a} get?",
    "A train travels {b} km per hour for {c} hours and then {e} km per hour for 2 hours. How far does it go?",
    "{a} reads {b} pages a day. The book has {f} pages. How many days does {a} need to finish it?",
    "A class has {b} students. {c} of them walk to school and the rest take the bus. If half of the bus riders "
    "sit in the front, how many sit in the front?",
    "{a} saves ${b} every week. How much has {a} saved after {c} weeks, after spending ${e} on a gift?",
    "A recipe needs {b} eggs for {c} people. How many eggs are needed for {g} people?",
    "A shop sells apples at {c} for ${b}. How much do {f} apples cost?",
    "{a} is {b} years old. {a}'s mother is {c} times as old. How old will the mother be in {e} years?",
    "A rectangle is {b} cm long and {c} cm wide. What are its area and its perimeter?",
    "{a} runs {b} laps of a {f} m track. How many kilometres is that?",
]


def _prose_passages(limit: int) -> list[tuple[str, str]]:
    """(module, passage) pairs: the first paragraphs of stdlib module docstrings, 400-1500 characters."""
    out = []
    for name in ["argparse", "asyncio", "base64", "bisect", "calendar", "collections", "contextlib", "csv",
                 "dataclasses", "datetime", "decimal", "difflib", "email", "enum", "fractions", "functools",
                 "gettext", "glob", "gzip", "heapq", "hmac", "html", "http.cookies", "inspect", "ipaddress",
                 "itertools", "locale", "logging", "mailbox", "mimetypes", "numbers", "operator", "optparse",
                 "pathlib", "pickle", "pprint", "queue", "random", "sched", "secrets", "selectors", "shelve",
                 "shlex", "shutil", "socketserver", "statistics", "string", "struct", "subprocess", "tarfile",
                 "tempfile", "textwrap", "threading", "timeit", "tokenize", "trace", "typing", "unittest",
                 "uuid", "warnings", "weakref", "zipfile", "zipimport", "zoneinfo"]:
        try:
            doc = importlib.import_module(name).__doc__ or ""
        except ImportError:
            continue
        text = re.sub(r"[ \t]+", " ", doc.strip())
        if len(text) < 400:
            continue
        out.append((name, text[:1500].rsplit("\n", 1)[0] if len(text) > 1500 else text))
        if len(out) == limit:
            break
    return out


def stream_prompts() -> list[dict[str, str]]:
    rng = random.Random(2026)
    rows: list[tuple[str, str]] = []
    topics = TOPICS[:]
    rng.shuffle(topics)
    for i, t in enumerate(topics * 2):
        rows.append(("writing", WRITING[i % len(WRITING)].format(t=t)))
    for i, t in enumerate(topics[:15]):
        rows.append(("roleplay", ROLEPLAY[i % len(ROLEPLAY)].format(t=t)))
    rows += [("qa", q) for q in QUESTIONS]
    rows += [("advice", q) for q in ADVICE]
    rows += [("reasoning", f"Compare {x} and {y} for {who}. Give the main pros and cons.") for x, y, who in COMPARE]
    rows += [("reasoning", q) for q in LOGIC]
    rows += [("coding", q) for q in CODING]
    rows += [("translation", f"Translate German to English: {s}") for s in GERMAN]
    for i in range(60):
        a = rng.choice(NAMES)
        b, c, e = rng.randint(3, 24), rng.randint(2, 9), rng.randint(2, 15)
        d, f, g = 10 * rng.randint(5, 12), 10 * rng.randint(12, 60), c * rng.randint(2, 5)
        rows.append(("math", MATH[i % len(MATH)].format(a=a, b=b, c=c, d=d, e=e, f=f, g=g)))
    for i, (name, text) in enumerate(_prose_passages(40)):
        if i % 2:
            rows.append(("summarization", f"Summarize the following text in a few sentences.\n\n{text}"))
        else:
            rows.append(("context", "Answer the question using only the context below.\n\n"
                         f"Context: {text}\n\nQuestion: What is the {name} module for, and what does it provide?"))
    return [{"category": c, "prompt": p} for c, p in rows]


def main() -> None:
    from mirrorsd.vocab_tables import prompts as shipped_prompts

    rows = stream_prompts()
    taken = {p["prompt"] for p in shipped_prompts("draft_vocab")}
    repeated = [r["prompt"] for r in rows if r["prompt"] in taken]
    if repeated or len({r["prompt"] for r in rows}) != len(rows):
        raise SystemExit(f"prompts repeated from the draft-vocabulary set or within this one: {repeated}")
    OUT.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    print(f"{OUT}: {len(rows)} prompts")


if __name__ == "__main__":
    main()
