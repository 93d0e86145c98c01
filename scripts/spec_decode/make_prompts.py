"""Writes the prompt files of the SmolLM2-135M-Instruct EAGLE-3 draft (train_smollm2_draft.sh): chat prompts built
from instruction templates over topics, plus summarization prompts over paragraphs of this repository's docs.
Training and held-out evaluation prompts use disjoint topics and disjoint paragraphs. The held-out file, once
written, is kept (the shipped draft was measured on it); rerunning the script rewrites the training file from docs/
as they are.

usage: python scripts/spec_decode/make_prompts.py [OUT_DIR]   (default: this script's directory)
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

TEMPLATES = [
    "Explain {t} in simple terms.", "Write a short poem about {t}.", "List three interesting facts about {t}.",
    "What are the pros and cons of {t}?", "Give me a one-paragraph summary of {t}.",
    "How would you teach {t} to a ten-year-old?", "Write a short story that involves {t}.",
    "What is the history of {t}?", "What are common misconceptions about {t}?",
    "Describe {t} in exactly five sentences.", "Write a tweet about {t}.", "Why does {t} matter?",
    "Compare {t} with something similar and explain the difference.", "Write a haiku about {t}.",
    "What questions should a beginner ask about {t}?", "Write an email to a friend recommending {t}.",
]
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "computes the n-th Fibonacci number",
    "counts the words in a sentence", "merges two sorted lists", "removes duplicates from a list",
    "finds the largest element of a list", "converts Celsius to Fahrenheit", "checks whether a word is a palindrome",
    "sums the digits of an integer", "flattens a nested list", "returns the factorial of n",
    "sorts a list of tuples by the second element", "counts the vowels in a string", "computes a running average",
    "finds the most common element of a list", "transposes a matrix", "parses a date string",
    "validates an email address", "implements binary search",
]
LANGS = ["Python", "JavaScript", "C", "Rust"]
TOPICS = [
    "photosynthesis", "the moon", "volcanoes", "coffee", "the Roman Empire", "black holes", "honeybees",
    "the internet", "climate change", "chess", "the piano", "rainbows", "electric cars", "dinosaurs", "sleep",
    "the ocean tides", "gravity", "bread baking", "the printing press", "vaccines", "cats", "mountains",
    "recycling", "the human heart", "friendship", "jazz music", "the Olympic games", "solar panels", "bicycles",
    "the stock market", "origami", "penguins", "the water cycle", "democracy", "meditation", "deserts",
    "machine learning", "the French Revolution", "tea", "earthquakes", "libraries", "the color blue", "robots",
    "gardening", "the speed of light", "whales", "board games", "the Renaissance", "public transport", "snow",
]
# Training-only topics (more contexts for the head: the 50 above gave 903 prompts, and held-out acceptance still rose
# with data); none is a held-out topic.
MORE_TOPICS = [
    "the Great Wall of China", "butterflies", "thunderstorms", "the Amazon rainforest", "pyramids", "octopuses",
    "the periodic table", "wind turbines", "cheese making", "the trumpet", "hot air balloons",
    "the Silk Road", "antibiotics", "rivers", "sunflowers", "the Industrial Revolution", "submarines", "elephants",
    "the human brain", "podcasts", "tornadoes", "the Eiffel Tower", "ancient Egypt", "maps", "chocolate",
    "the immune system", "trains", "the metric system", "ants", "DNA", "skateboarding", "the Moon landing",
    "rice farming", "nuclear energy", "wolves", "the Vikings", "smartphones", "yoga", "the Sahara", "clocks",
    "frogs", "the Milky Way", "pottery", "email", "mushrooms", "the Great Barrier Reef", "kites", "salt",
    "the alphabet", "bridges", "comets", "the Pacific Ocean", "sharks", "video games", "sundials", "camels",
    "the Wright brothers", "batteries", "opera", "tigers", "the ozone layer", "spices", "skyscrapers", "fossils",
    "hurricanes", "the Aztecs", "microscopes", "dolphins", "the guitar", "sculpture", "the Arctic", "compost",
    "rockets", "the postal service", "parrots", "the Sun", "knitting", "the Nile", "magnets", "kangaroos",
    "ancient Greece", "writing letters", "bats", "soap", "volunteering", "the rainforest canopy",
    "semiconductors", "the bicycle chain", "maple syrup", "the Internet of Things", "sea turtles", "mathematics",
    "the Pythagorean theorem", "prime numbers", "cooking pasta", "the Cold War", "blockchains", "hiking",
    "the Himalayas", "windmills", "ballet", "seeds", "the first computers", "architecture", "spiders",
    "the Titanic", "cloud computing", "camping", "the Mona Lisa", "airplanes", "the microwave oven", "lions",
    "chairs", "poetry", "the census", "insulin", "geysers", "the Statue of Liberty",
    "cryptography", "photography", "the Great Depression", "the moon's phases", "honey", "open source software",
    "the Northern Lights", "rain", "the bicycle helmet", "language learning", "the Mayan calendar", "horses",
    "city parks", "the ancient Olympics", "sand", "the speed of sound", "carbon dioxide", "oak trees",
    "public speaking", "the Arctic fox", "recipes", "the harmonica", "weather forecasts", "time zones",
    "the stethoscope", "fireworks", "railways in India", "the Andes", "firefighters", "the human skeleton",
    "pizza", "museums", "wildfires", "the Mars rovers", "bees' dances", "glass making", "the compass",
]
HELD_OUT_TOPICS = ["lighthouses", "coral reefs", "the violin", "autumn", "paper money", "owls", "glaciers",
                   "the telescope", "soccer", "bamboo"]


def doc_paragraphs(root: Path):
    paras = []
    for f in sorted((root / "docs").glob("*.md")):
        for block in f.read_text(encoding="utf-8").split("\n\n"):
            text = " ".join(block.split())
            if 200 <= len(text) <= 1200 and not text.startswith(("#", "|", "```", "-")):
                paras.append(text)
    return paras


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
    root = Path(__file__).resolve().parents[2]
    rng = random.Random(0)
    train = [tpl.format(t=t) for t in TOPICS + MORE_TOPICS for tpl in TEMPLATES]
    train += [f"Write a {lang} function that {task}." for task in CODE_TASKS[:16] for lang in LANGS]
    held = [tpl.format(t=t) for t in HELD_OUT_TOPICS for tpl in rng.sample(TEMPLATES, 3)]
    held += [f"Write a {lang} function that {task}." for task in CODE_TASKS[16:] for lang in LANGS[:2]]
    paras = doc_paragraphs(root)
    rng.shuffle(paras)
    summary = "Summarize this in two sentences:\n\n"
    held_file = out / "smollm2_eval_prompts.jsonl"
    if held_file.exists():
        # The held-out set stays what it was when the shipped draft was measured (docs/ changes, and with it the
        # paragraphs); its paragraphs stay out of training.
        kept = [json.loads(line)["messages"][0]["content"] for line in held_file.read_text("utf-8").splitlines()]
        held = None
        held_paras = {c[len(summary):] for c in kept if c.startswith(summary)}
        train += [summary + p for p in paras if p not in held_paras]
    else:
        n_held = max(1, len(paras) // 10)
        held += [summary + p for p in paras[:n_held]]
        train += [summary + p for p in paras[n_held:]]
    rng.shuffle(train)
    for name, prompts in (("smollm2_train_prompts.jsonl", train), (held_file.name, held)):
        if prompts is None:
            continue
        with open(out / name, "w", encoding="utf-8") as f:
            for p in prompts:
                f.write(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n")
        print(f"{out / name}: {len(prompts)} prompts")


if __name__ == "__main__":
    main()
