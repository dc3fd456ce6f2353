"""A repeated-task workload (``data=repeated_records``, source ``repeated``): the same kind of request sent
again and again with a varying payload, in a fixed order, as an agent sends them. Each request is one fixed
system block (the task, the output schema, the rules, one worked example) and a user turn holding one contact
record to convert into that JSON schema; the records come in four layouts (``key: value`` lines, a sentence, a
CSV row with its header, ``|``-separated fields), some with a field missing (null in the answer).

Why: drafters that learn from earlier requests (suffix drafting over past outputs) or from several occurrences
in one text (prompt lookup trees) pay on exactly this traffic, which none of the project's other sets is; its
answers copy keys from the schema and values from the record.

The records are generated from fixed word lists by ``random.Random(data.split_seed)``: deterministic, no
training data and no evaluation set in them, nothing downloaded. ``RECORDS`` requests, ids
``repeated_records/00``...; each record also carries ``reference``, the JSON answer the rules ask for.
"""

from __future__ import annotations

import json
import random

RECORDS = 32

SYSTEM = """You are a data-cleaning step in a CRM import pipeline. Each message holds one contact record, \
copied from an email signature, a spreadsheet or a web form. Convert it into exactly one JSON object with \
these keys, in this order:
{"name": string, "email": string, "company": string, "city": string, "country": string, \
"phone": string or null, "role": string, "since": "YYYY-MM-DD"}
Rules: keep names and companies as written; write the email in lower case; write the phone number with its \
country code and no spaces (null if the record has none); write the date as YYYY-MM-DD. Output only the JSON \
object, with no explanation.
Example record:
name: Ada Byron | email: Ada.Byron@Example.org | company: Analytical Engines | city: London | country: United \
Kingdom | phone: +44 20 7946 0958 | role: Engineer | customer since: 1843-09-05
Example output:
{"name": "Ada Byron", "email": "ada.byron@example.org", "company": "Analytical Engines", "city": "London", \
"country": "United Kingdom", "phone": "+442079460958", "role": "Engineer", "since": "1843-09-05"}"""

FIRST = ["Maria", "Kenji", "Amara", "Lucas", "Priya", "Tomasz", "Elena", "Samuel", "Fatima", "Oskar", "Nadia"]
LAST = ["Okafor", "Lindqvist", "Moreau", "Tanaka", "Haddad", "Novak", "Silva", "Brennan", "Kowalski", "Reyes"]
COMPANIES = ["Northwind Traders", "Bluefin Logistics", "Helios Robotics", "Quarry & Stone", "Lumen Health"]
PLACES = [
    ("Lyon", "France", "+33"),
    ("Osaka", "Japan", "+81"),
    ("Lagos", "Nigeria", "+234"),
    ("Porto", "Portugal", "+351"),
    ("Krakow", "Poland", "+48"),
    ("Austin", "United States", "+1"),
    ("Gothenburg", "Sweden", "+46"),
]
ROLES = ["Procurement Manager", "Data Analyst", "Head of Operations", "Sales Lead", "CTO", "Office Manager"]
LABELS = ["name", "email", "company", "city", "country", "phone", "role", "customer since"]


def contact(rng: random.Random) -> dict[str, str | None]:
    """One random contact, as the JSON answer holds it."""
    first, last, company = rng.choice(FIRST), rng.choice(LAST), rng.choice(COMPANIES)
    city, country, code = rng.choice(PLACES)
    domain = company.lower().replace(" & ", "").replace(" ", "") + ".com"
    digits = "".join(str(rng.randrange(10)) for _ in range(9))
    return {
        "name": f"{first} {last}",
        "email": f"{first}.{last}@{domain}".lower(),
        "company": company,
        "city": city,
        "country": country,
        "phone": None if rng.random() < 0.25 else code + digits,
        "role": rng.choice(ROLES),
        "since": f"{rng.randrange(2009, 2025)}-{rng.randrange(1, 13):02d}-{rng.randrange(1, 29):02d}",
    }


def written(record: dict[str, str | None], layout: int) -> str:
    """The record as a user would paste it, in one of four layouts; the email and phone written loosely."""
    first, last = record["name"].split(" ")
    shown = dict(record, email=record["email"].replace(first.lower(), first).replace(last.lower(), last))
    if record["phone"]:
        phone = record["phone"]
        shown["phone"] = f"{phone[:-9]} {phone[-9:-6]} {phone[-6:-3]} {phone[-3:]}"
    year, month, day = record["since"].split("-")
    shown["since"] = f"{day}/{month}/{year}"
    values = [shown[key] for key in ("name", "email", "company", "city", "country", "phone", "role", "since")]
    pairs = [(label, value) for label, value in zip(LABELS, values, strict=True) if value is not None]
    if layout == 0:
        return "\n".join(f"{label}: {value}" for label, value in pairs)
    if layout == 1:
        phone = f", phone {shown['phone']}" if shown["phone"] else ""
        return (
            f"{shown['name']} ({shown['email']}) is {shown['role']} at {shown['company']} in {shown['city']}, "
            f"{shown['country']}{phone}; a customer since {shown['since']}."
        )
    if layout == 2:
        return ",".join(label for label, _ in pairs) + "\n" + ",".join(str(value) for _, value in pairs)
    return " | ".join(f"{label}: {value}" for label, value in pairs)


def repeated_records(seed: int = 0, count: int = RECORDS) -> list[dict]:
    """``count`` requests in their fixed order (see the module docstring): ``id``, ``messages`` (the system
    block, then the record), ``reference`` (the JSON answer)."""
    rng = random.Random(seed)
    records = []
    for i in range(count):
        record = contact(rng)
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Record:\n" + written(record, rng.randrange(4))},
        ]
        reference = json.dumps(record, ensure_ascii=False)
        records.append({"id": f"repeated_records/{i:02d}", "messages": messages, "reference": reference})
    return records
