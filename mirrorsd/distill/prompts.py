"""The distillation prompts: our own, from templates × topics (Python's standard library and its docs, general
subjects) and the model's self-instruct questions, never from Spec-Bench.

Drafts must be right on *novel* text, so the prompts cover what a chat model is asked: code, questions, translation,
math word problems, answers from a given context, summaries of passages the model writes itself, multi-turn
conversations and the model's own questions (self-instruct). Everything is built from code and the interpreter's
own files, deterministically: the same version gives the same prompts on every machine, so a run resumes by id.
:func:`leaks` is the test set's guard: no 13-token window of a prompt may occur in a Spec-Bench question.
"""

from __future__ import annotations

import ast
import hashlib
import random
import re
import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

# 2: the chat kinds (:func:`chat_items`), appended after version 1's prompts, whose ids stay as they were.
# 3: more of the chat kinds (:func:`more_chat_items`), appended after version 2's.
VERSION = 3
# A shard stores a kind as its index here: append only.
KINDS = ("code", "qa", "translation", "math", "context", "summarize-own", "multi-turn", "self-instruct",
         "chat", "user-voice", "trivia", "to-english")
SELF_INSTRUCT = "self-instruct"
ASKED_ANEW = frozenset({SELF_INSTRUCT, "user-voice", "trivia"})  # the last answer (a question) is then asked anew
LEAK_WINDOW = 13


@dataclass(frozen=True)
class Prompt:
    """One item: user turns answered in order in one conversation (``self-instruct``: the first answer is then
    asked in a conversation of its own)."""

    id: int
    kind: str
    turns: tuple[str, ...]


GENERAL = (
    "the water cycle", "photosynthesis", "volcanoes", "the Roman Empire", "the printing press", "black holes",
    "vaccines", "the human heart", "coral reefs", "plate tectonics", "the French Revolution", "solar panels",
    "bread baking", "coffee roasting", "honeybees", "the Silk Road", "electric cars", "rainforests", "glaciers",
    "the immune system", "compound interest", "inflation", "supply and demand", "the stock market", "budgeting",
    "chess openings", "marathon training", "sleep hygiene", "meditation", "composting", "urban gardening",
    "recycling plastics", "wind turbines", "nuclear fission", "the periodic table", "DNA replication", "evolution",
    "dinosaurs", "the Moon landing", "Mars exploration", "satellites", "the internet", "email etiquette",
    "public speaking", "job interviews", "time management", "learning a language", "jazz music", "the violin",
    "oil painting", "photography basics", "film editing", "board games", "origami", "knitting", "camping",
    "mountain climbing", "ocean tides", "hurricanes", "earthquakes", "weather forecasting", "climate change",
    "renewable energy", "fermentation", "cheese making", "tea ceremonies", "spices", "olive oil", "chocolate",
    "the Great Wall of China", "ancient Egypt", "the Renaissance", "the Industrial Revolution", "railways",
    "airplanes", "bicycles", "bridges", "skyscrapers", "public libraries", "museums", "national parks",
    "endangered species", "bird migration", "octopuses", "whales", "ants", "mushrooms", "trees in winter",
    "first aid", "nutrition labels", "vitamins", "hydration", "running shoes", "home insulation", "3D printing",
    "robots", "smartphones", "batteries", "semiconductors", "prime numbers", "probability", "statistics",
    "geometry", "fractions", "the Pythagorean theorem", "maps and navigation", "time zones", "calendars",
    "the Olympic Games", "football tactics", "swimming technique", "yoga", "pets", "dog training", "cats",
    "aquariums", "houseplants", "moving house", "saving money", "renting an apartment", "volunteering",
    "team work", "negotiation", "writing a resume", "open source software", "password security", "backups",
)

CODE = (
    "Write a short Python example that uses the `{m}` module, and explain each line.",
    "What is Python's `{m}` module for? Show a typical use.",
    "Show two common mistakes people make with Python's `{m}` module and how to avoid them.",
    "Write a Python function that uses `{m}` to solve a small practical task, with a docstring and a test.",
    "Explain when to use the `{m}` module instead of writing the code by hand.",
    "Give me a cheat sheet of the most useful functions in Python's `{m}` module.",
    "Write a command-line script that demonstrates the `{m}` module.",
    "How would you unit test code that depends on Python's `{m}` module?",
    "Refactor a loop-heavy snippet into idiomatic Python using `{m}`. Show before and after.",
    "Compare `{m}` with a third-party alternative you know, in a short table.",
)
TASKS = (
    "reverse a linked list", "check whether a string is a palindrome", "merge two sorted lists",
    "count word frequencies in a text", "find the longest common prefix of a list of strings",
    "compute the nth Fibonacci number iteratively", "validate an email address with a regular expression",
    "flatten a nested list", "remove duplicates while keeping order", "parse a CSV line with quoted fields",
    "implement binary search", "rotate a matrix by 90 degrees", "find all anagrams in a word list",
    "compute the median of a stream of numbers", "convert Roman numerals to integers",
    "implement a least-recently-used cache", "detect a cycle in a directed graph", "tokenize arithmetic expressions",
    "evaluate a postfix expression", "generate all permutations of a list", "compute a running average",
    "find the k most common elements", "group records by a key", "pretty-print a table of rows",
    "read a file in chunks and count lines", "retry a function call with exponential backoff",
    "implement a simple state machine", "serialize a tree to a string and back", "compute edit distance",
    "schedule tasks by priority with a heap",
)
LANGUAGES_CODE = ("Python", "JavaScript", "Go", "Rust", "C")
TASK_TEMPLATES = ("Write a {lang} function to {task}. Explain its time complexity.",
                  "In {lang}, how do I {task}? Give code and a short explanation.")

QA = (
    "Explain {t} to a curious twelve-year-old.", "What are three surprising facts about {t}?",
    "What is the history of {t} in a few paragraphs?", "What are the pros and cons of {t}?",
    "How does {t} work? Keep it under 200 words.", "What misconceptions do people have about {t}?",
    "Give me a step-by-step beginner's guide to {t}.", "Why does {t} matter today?",
    "Write five quiz questions about {t}, with answers.", "What should I read to learn more about {t}?",
    "Describe {t} using an everyday analogy.", "What questions do experts still debate about {t}?",
)
MEMBER = ("Show how to use `{f}` from Python's standard library, with a small runnable example.",
          "What does `{f}` do in Python? Explain its arguments and return value.",
          "Write a test that checks the behaviour of `{f}` on an edge case, and explain the edge case.")
STDLIB_QA = (
    "In Python, what problem does the `{m}` module solve, and what are its limits?",
    "What changed in Python's `{m}` module over the years, as far as you know?",
    "Which functions of `{m}` are thread-safe, and why does it matter?",
)

LANGUAGES = ("French", "German", "Spanish", "Italian", "Portuguese", "Chinese", "Japanese", "Russian", "Dutch",
             "Korean")
TRANSLATE = ("Translate into {lang}: {s}", "Translate the following sentence into {lang}.\n\n{s}",
             "How would you say this in {lang}? \"{s}\"")

MATH = (
    "A shop sells pencils at {a} cents each and erasers at {b} cents each. Maya buys {c} pencils and {d} erasers. "
    "How much does she pay in dollars?",
    "A train travels {a} km in {b} hours, then {c} km in {d} hours. What is its average speed for the whole trip?",
    "A tank holds {a} liters. It leaks {b} liters per hour while a pipe adds {c} liters per hour. Starting full, "
    "after how many hours does it hold {d} liters?",
    "Tom has {a} marbles. He gives a third of them to Ann, then buys {b} more and loses {c}. How many does he have?",
    "A rectangle is {a} cm long and {b} cm wide. A square has the same perimeter. What is the square's area?",
    "A recipe needs {a} grams of flour for {b} cookies. How much flour is needed for {c} cookies?",
    "{a} workers build a wall in {b} days. How long would {c} workers take at the same rate?",
    "An item costs {a} dollars. It is discounted by {b} percent, then taxed at {c} percent. What is the final price?",
    "A class has {a} students; {b} percent are girls and {c} of the girls wear glasses. What share of the class "
    "are girls with glasses?",
    "Sam saves {a} dollars a week and spends {b} dollars every {c} weeks. How much has he saved after {d} weeks?",
    "A car uses {a} liters of fuel per 100 km. Fuel costs {b} cents per liter. What does a {c} km trip cost?",
    "Two numbers add up to {a} and differ by {b}. What are they?",
    "A garden is {a} m by {b} m with a path {c} m wide around it. What is the area of the path?",
    "A bacteria culture doubles every {a} minutes. Starting with {b} cells, how many are there after {c} minutes?",
    "An account pays {a} percent interest per year, compounded yearly. What does {b} dollars grow to in {c} years?",
    "A clock gains {a} seconds every hour. How many minutes fast is it after {b} days?",
    "Pipes A and B fill a pool in {a} and {b} hours. How long do they take together?",
    "A bag has {a} red, {b} blue and {c} green balls. What is the probability of drawing two reds in a row "
    "without replacement?",
)

CONTEXT = (
    "Read the text below and answer: what are its main points?\n\n{p}",
    "Here is some documentation:\n\n{p}\n\nBased only on this text, what would a beginner most likely "
    "misunderstand?",
    "{p}\n\nUsing only the passage above, write three questions it answers, and answer them.",
    "Context:\n{p}\n\nQuestion: what does this text say one should do, and why?",
    "Answer from the passage only. Passage:\n{p}\n\nWhich terms does it define, and how?",
)

WRITE = ("Write a short informative passage (about 150 words) about {t}.",
         "Write a paragraph-long news-style report about a recent development in {t}.",
         "Write a short essay about {t} with an introduction and a conclusion.")
SUMMARIZE = ("Summarize the passage above in two sentences.", "Give a one-line summary of what you wrote.",
             "Now condense that into three bullet points.")

FOLLOW_UPS = ("Can you give a concrete example?", "Make that shorter, please.", "Explain the second point in more "
              "detail.", "What would be a common mistake here?", "Can you say the same thing more formally?",
              "Now write it as a numbered list.", "How would you explain this to a beginner?",
              "What is a good follow-up topic to learn next?")

SELF = ("Write one question a student might ask about {t}. Reply with the question only.",
        "Ask me one hard but fair exam question about {t}. Reply with the question only.",
        "Write one practical question someone might ask an assistant about {t}. Reply with the question only.")


# The chat kinds (version 2). Streams trained on version 1's answers gained on more of them but not on Spec-Bench's
# (docs/speculative_streaming.md, "Why the distilled gain does not reach Spec-Bench"): those prompts are about Python
# and templated. These are what a chat assistant's users ask: writing, role-play, advice, reasoning, in a user's own
# voice, short facts, and translation *into* English. Built from the lists below alone, the same on every machine.
FORMS = ("a short poem", "a limerick", "the opening paragraph of a short story", "a persuasive paragraph",
         "a polite email to a colleague", "a product description for an online shop", "a travel blog introduction",
         "a two-minute motivational speech", "a dialogue between two friends", "a diary entry",
         "a letter to my future self", "five catchy headlines", "a short review, as if you had just tried it",
         "a children's bedtime story", "a job advert", "a funny text message to a friend")
ROLES = ("a tour guide in Rome", "a history teacher", "a chef in a busy kitchen", "a personal trainer",
         "a detective in 1920s London", "a ship's captain in a storm", "a museum curator", "a librarian",
         "a startup founder pitching to investors", "a park ranger", "a medieval blacksmith", "an astronaut on the "
         "space station", "a kind grandmother", "a sports commentator", "a customer support agent", "a wizard")
ROLE_ASKS = ("Pretend you are {r}. Introduce yourself and describe a typical day.",
             "Act as {r}. I am a visitor who knows nothing: what should I know first?",
             "Stay in character as {r} and tell me about the hardest moment of your career.",
             "You are {r}. Answer in character: what do you wish people understood about your work?")
SITUATIONS = ("I just moved to a new city and know nobody", "my roommate never cleans the kitchen",
              "I have an exam in three days and have not started", "my manager gives me vague feedback",
              "I want to start running but always give up after a week", "my phone distracts me while I work",
              "I have to give a toast at my sister's wedding", "my small bakery has fewer customers this year",
              "I keep forgetting my friends' birthdays", "I want to change careers at forty",
              "my team disagrees about which project to do first", "I feel tired every afternoon",
              "my neighbour plays loud music at night", "I want to save for a house", "I am nervous about flying",
              "my teenage son spends all day gaming", "I was offered two jobs and cannot choose",
              "I want to read more books this year", "my garden tomatoes keep dying", "I procrastinate on emails",
              "I have to fire an employee for the first time", "my parents want me to visit more often",
              "I would like to learn to cook healthy meals on a budget", "I want to plan a surprise party",
              "my dog barks whenever I leave the house", "I have trouble falling asleep",
              "I want to ask for a raise", "I made a mistake that cost my company money",
              "my friend always cancels plans at the last minute", "I want to volunteer but have little time")
ADVICE = ("{s}. What should I do?", "Can you help me? {s}. Give me a short plan.",
          "{s}. What are three things I could try this week?")
NAMES = ("Alice", "Ben", "Chloe", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kira", "Luca")
REASONING = (
    "{a}, {b} and {c} finished a race. {a} was not first, and {c} finished right after {b}. Who won? Explain.",
    "{a} is older than {b}, and {c} is younger than {b}. Who is the youngest? Show your reasoning.",
    "{a} says {b} is lying. {b} says {c} is lying. {c} says both {a} and {b} are lying. Who tells the truth?",
    "{a} has twice as many books as {b}, and {c} has {n} fewer than {a}. Together they have {m}. How many does "
    "each have?",
    "If it takes {n} machines {n} minutes to make {n} widgets, how long would {m} machines take to make {m} "
    "widgets? Explain carefully.",
    "{a} sits to the left of {b}, and {c} sits opposite {a} at a square table with four seats. Where can the "
    "fourth person sit? Reason step by step.",
)
PERSONAS = ("a busy parent", "a retired teacher", "a high-school student", "a small business owner", "a nurse on "
            "night shifts", "a software engineer", "a tourist abroad", "a first-time novelist", "a farmer",
            "a university professor")
USER_VOICE = "Write a message that {p} might send to an AI assistant about {t}. Reply with the message only."
TRIVIA = ("Write one short factual question about {t} that has a one-sentence answer. Reply with the question only.",
          "Write one quiz question about {t} whose answer is a name, a date or a number. Reply with the question "
          "only.")
PLACES = ("Japan", "Brazil", "Kenya", "Norway", "Canada", "India", "Mexico", "Egypt", "Australia", "Peru",
          "Iceland", "Vietnam", "Morocco", "Argentina", "Turkey", "Greece", "Portugal", "Indonesia", "Chile",
          "New Zealand", "Scotland", "Poland", "Thailand", "South Korea", "Ireland", "Nigeria", "Cuba", "Finland",
          "Switzerland", "Mongolia", "Paris", "Tokyo", "New York", "Cairo", "Istanbul", "Sydney", "Buenos Aires",
          "Mumbai", "Venice", "Prague", "the Amazon river", "the Sahara", "the Himalayas", "the Alps", "the Nile",
          "Antarctica", "the Pacific Ocean", "the Mediterranean Sea", "the Great Barrier Reef", "Mount Everest")
FOREIGN = ("German", "French", "Spanish", "Italian")
TO_ENGLISH = (("Write three sentences about {t} in {lang}.", "Translate what you wrote into English."),
              ("Describe {t} in {lang}, in one paragraph.", "Now translate your text into natural English."),
              ("Write a short {lang} paragraph about {t}, as a newspaper would.", "Translate it into English."))


def _writing(forms: Sequence[str], personas: Sequence[str], roles: Sequence[str],
             situations: Sequence[str]) -> list[tuple[str, tuple[str, ...]]]:
    """A chat wave's writing, user-voice, role-play and advice prompts, in build order."""
    items: list[tuple[str, tuple[str, ...]]] = []
    for t in GENERAL:
        for form in forms:
            items.append(("chat", (f"Write {form} about {t}.",)))
        for p in personas:
            items.append(("user-voice", (USER_VOICE.format(p=p, t=t),)))
    for r in roles:
        for ask in ROLE_ASKS:
            items.append(("chat", (ask.format(r=r),)))
    for s in situations:
        for ask in ADVICE:
            items.append(("chat", (ask.format(s=s),)))
    return items


def chat_items(seed: int = 2) -> list[tuple[str, tuple[str, ...]]]:
    """The chat kinds' prompts as (kind, turns), in a seeded order (any prefix covers every kind)."""
    rng = random.Random(seed)
    items = _writing(FORMS, PERSONAS, ROLES, SITUATIONS)
    for i in range(600):
        a, b, c = rng.sample(NAMES, 3)
        n = rng.randint(2, 9)
        items.append(("chat", (REASONING[i % len(REASONING)].format(a=a, b=b, c=c, n=n, m=n * rng.randint(3, 12)),)))
    for t in (*GENERAL, *PLACES):
        for q in TRIVIA:
            items.append(("trivia", (q.format(t=t),)))
    for i, t in enumerate((*GENERAL, *PLACES)):
        for j, (first, then) in enumerate(TO_ENGLISH):
            items.append(("to-english", (first.format(t=t, lang=FOREIGN[(i + j) % len(FOREIGN)]), then)))
    unique = list(dict.fromkeys(items))
    rng.shuffle(unique)
    return unique


# Version 3: the chat kinds were the only answers whose gain reached Spec-Bench, and version 2's were nearly all
# answered. New forms, personas, roles, situations and questions over the same subjects.
FORMS_MORE = ("a short speech for a school assembly", "a blog post outline with headings", "a short news report",
              "a thank-you note", "a short scene for a play", "a riddle and its answer",
              "a FAQ with four questions and answers", "a thread of five short social media posts",
              "a thirty-second radio advertisement", "a short fable with a moral", "a formal complaint letter",
              "a podcast episode description", "a short essay with an introduction and a conclusion",
              "a packing list with a sentence on each item")
PERSONAS_MORE = ("a worried grandparent", "a college athlete", "a city council member", "a recent immigrant",
                 "a graduate student", "a freelance designer")
ROLES_MORE = ("a lighthouse keeper", "a hotel concierge", "a veterinarian", "a street musician", "a pilot",
              "a gardener at a royal palace", "a news anchor", "a mountain guide", "a bookshop owner",
              "a pastry chef", "a train conductor", "a marine biologist")
SITUATIONS_MORE = ("my coworker takes credit for my ideas", "I want to learn to play the guitar as an adult",
                   "my apartment is always cluttered", "I am moving abroad for a year",
                   "I need to write my first grant proposal", "my kids argue every morning before school",
                   "I spend too much money on takeaway food", "I want to run a half marathon in six months",
                   "I have to present to the board next week", "my best friend and I had a big argument",
                   "I cannot decide which laptop to buy", "I want to start a vegetable garden on my balcony",
                   "my new puppy chews everything", "I am hosting a dinner for ten people",
                   "I want to become better at remembering names")
TRIVIA_MORE = ("Write one question about {t} that a curious child might ask. Reply with the question only.",
               "Write one question about {t} that takes a short explanation to answer. Reply with the question "
               "only.")
TO_ENGLISH_MORE = (("Write a short dialogue in {lang} between two people talking about {t}.",
                    "Translate the dialogue into English."),
                   ("Write four sentences in {lang} that a guidebook might say about {t}.",
                    "Give an English translation."))


def more_chat_items(seed: int = 3) -> list[tuple[str, tuple[str, ...]]]:
    """Version 3's chat-kind prompts as (kind, turns), in a seeded order (any prefix covers every kind)."""
    items = _writing(FORMS_MORE, PERSONAS_MORE, ROLES_MORE, SITUATIONS_MORE)
    for i, t in enumerate((*GENERAL, *PLACES)):
        for q in TRIVIA_MORE:
            items.append(("trivia", (q.format(t=t),)))
        for j, (first, then) in enumerate(TO_ENGLISH_MORE):
            items.append(("to-english", (first.format(t=t, lang=FOREIGN[(i + j + 1) % len(FOREIGN)]), then)))
    unique = list(dict.fromkeys(items))
    random.Random(seed).shuffle(unique)
    return unique


CHAT_WAVES = (chat_items, more_chat_items)  # appended after version 1 in this order: a folder grows wave by wave


def extend(prompts: Sequence[Prompt], items: Sequence[tuple[str, tuple[str, ...]]]) -> list[Prompt]:
    """``prompts`` with the ``items`` they lack appended, ids going on: a frozen set grows without renumbering."""
    have = {(p.kind, p.turns) for p in prompts}
    new = [item for item in dict.fromkeys(items) if item not in have]
    return [*prompts, *(Prompt(len(prompts) + i, kind, turns) for i, (kind, turns) in enumerate(new))]


def stdlib_docs() -> tuple[dict[str, str], dict[str, str]]:
    """The interpreter's own standard library, read and never imported: module name → docstring, and
    ``module.name`` → docstring of its public top-level functions and classes."""
    modules, members = {}, {}
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        if path.stem.startswith("_") or path.stem in ("this", "antigravity"):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:
            continue
        doc = ast.get_docstring(tree)
        if doc and len(doc.split()) >= 8:
            modules[path.stem] = doc
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                if doc and len(doc.split()) >= 8:
                    members[f"{path.stem}.{node.name}"] = doc
    return modules, members


def sentences(texts: Iterable[str], lo: int = 6, hi: int = 30) -> list[str]:
    """Plain-prose sentences of ``lo``..``hi`` words from ``texts``, in order, once each."""
    seen: dict[str, None] = {}
    for text in texts:
        for paragraph in re.split(r"\n\s*\n", text):
            if re.search(r"[>{}=_\[\]|\\]|\.\.\.|::", paragraph):  # code, tables, doctests
                continue
            for s in re.split(r"(?<=[.!?])\s+", " ".join(paragraph.split())):
                if lo <= len(s.split()) <= hi and s[0].isupper() and s.endswith("."):
                    seen.setdefault(s, None)
    return list(seen)


def passages(texts: Iterable[str], lo: int = 40, hi: int = 220) -> list[str]:
    """Paragraph runs of ``lo``..``hi`` words: the contexts of answer-from-context prompts."""
    out: dict[str, None] = {}
    for text in texts:
        run: list[str] = []
        for paragraph in re.split(r"\n\s*\n", text):
            words = paragraph.split()
            if not words:
                continue
            if sum(len(p.split()) for p in run) + len(words) > hi:
                if run and sum(len(p.split()) for p in run) >= lo:
                    out.setdefault("\n\n".join(run), None)
                run = []
            if len(words) <= hi:
                run.append(paragraph.strip())
        if run and sum(len(p.split()) for p in run) >= lo:
            out.setdefault("\n\n".join(run), None)
    return list(out)


def build(seed: int = 0) -> list[Prompt]:
    """Every distillation prompt: version 1's eight kinds interleaved (any prefix covers all of them), ids in that
    order, then the chat kinds (:func:`extend`)."""
    from pydoc_data.topics import topics

    docs, members = stdlib_docs()
    modules = sorted(docs)
    rng = random.Random(seed)
    items: list[tuple[str, tuple[str, ...]]] = []
    add = lambda kind, *turns: items.append((kind, turns))  # noqa: E731

    for m in modules:
        for t in CODE:
            add("code", t.format(m=m))
        for t in STDLIB_QA:
            add("qa", t.format(m=m))
    for f in sorted(members):
        for t in MEMBER:
            add("code", t.format(f=f))
    for task in TASKS:
        for lang in LANGUAGES_CODE:
            for t in TASK_TEMPLATES:
                add("code", t.format(lang=lang, task=task))
    for topic in GENERAL:
        for t in QA:
            add("qa", t.format(t=topic))
    texts = [*docs.values(), *(topics[k] for k in sorted(topics)), *(members[k] for k in sorted(members))]
    for i, s in enumerate(sentences(texts)[:6000]):
        add("translation", TRANSLATE[i % len(TRANSLATE)].format(lang=LANGUAGES[(i // 3) % len(LANGUAGES)], s=s))
    for i in range(4000):
        numbers = {k: rng.randint(2, 60) for k in "abcd"}
        add("math", MATH[i % len(MATH)].format(**numbers))
    for i, p in enumerate(passages(texts)):
        for j in range(2):
            add("context", CONTEXT[(2 * i + j) % len(CONTEXT)].format(p=p))
    for subject in [*GENERAL, *(f"Python's {m} module" for m in modules)]:
        for i, t in enumerate(WRITE):
            add("summarize-own", t.format(t=subject), SUMMARIZE[i])
    for subject in [*GENERAL, *(f"Python's {m} module" for m in modules), *(f"`{f}` in Python" for f in
                                                                            sorted(members)[::3])]:
        for t in SELF:
            add(SELF_INSTRUCT, t.format(t=subject))
    firsts = [turns[0] for kind, turns in items if kind in ("code", "qa")]
    for i, first in enumerate(rng.sample(firsts, min(4500, len(firsts)))):
        add("multi-turn", first, FOLLOW_UPS[i % len(FOLLOW_UPS)])

    unique = list(dict.fromkeys(items))  # distinct prompts only
    rng.shuffle(unique)
    prompts = [Prompt(i, kind, turns) for i, (kind, turns) in enumerate(unique)]
    for wave in CHAT_WAVES:
        prompts = extend(prompts, wave())
    return prompts


def digest(prompts: Sequence[Prompt]) -> str:
    """A fingerprint of the prompt set: an output folder is only resumed with the same prompts."""
    h = hashlib.sha256()
    for p in prompts:
        h.update(f"{p.id}\t{p.kind}\t{chr(30).join(p.turns)}\n".encode())
    return h.hexdigest()[:16]


def windows(ids: Sequence[int], n: int = LEAK_WINDOW) -> set[tuple[int, ...]]:
    return {tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)}


def leaks(prompts: Sequence[Prompt], tokenize, questions: Iterable[str], n: int = LEAK_WINDOW) -> list[int]:
    """Ids of the prompts with an ``n``-token window (``tokenize``: text → ids) that occurs in ``questions``."""
    test: set[tuple[int, ...]] = set()
    for q in questions:
        test |= windows(tokenize(q), n)
    return [p.id for p in prompts if any(windows(tokenize(turn), n) & test for turn in p.turns)]
