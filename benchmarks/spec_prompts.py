"""Prompts of the speculative-decoding benchmark (`benchmarks.spec_decode`), written by hand.

Input-grounded prompts: each holds a passage of a few hundred tokens that a good answer copies
from (rewrite a paragraph, extract fields to JSON, edit a code snippet, summarize with verbatim
quotes), 8 of each kind; prompt-lookup drafting finds its drafts there. Open chat prompts: short
questions whose answers copy nothing (the case where drafts rarely exist). Every name, number and
event in the passages is invented.
"""

from __future__ import annotations

from typing import NamedTuple


class Prompt(NamedTuple):
    id: str  # "<kind>-<n>", stable across runs (the greedy-equality diffs name it)
    kind: str  # rewrite | extract | code | summarize | chat
    text: str  # the user message


GROUNDED_KINDS = ("rewrite", "extract", "code", "summarize")

# ---- rewrite a paragraph ---------------------------------------------------------------------

_REWRITE = [
    (
        "Fix every spelling and grammar mistake in the paragraph below. Keep the wording, the "
        "names and the numbers as they are; change nothing else.",
        "The town of Harlow Bridge have a small public library that was build in 1911 with money "
        "from a local mill owner named Agnes Pell. For most of it's history the library only "
        "opened three days a week, becuase the town could not afford more then one librarian. In "
        "1987 a group of volunteers, lead by a retired teacher called Martin Osei, started to "
        "open the building on the remaining days, and within two years the number of visitors "
        "had almost doubled. The volunteers also started a reading club for children, which met "
        "every Saturday morning in the old map room on the second floor. Today the library has "
        "four paid staff and more then sixty volunteers, and it lends around 48,000 books a "
        "year. The map room is still used by the reading club, although the maps themself were "
        "moved to the county archive in 2004 after a leak in the roof damaged several of them. "
        "A new roof were finally installed in 2019, payed for by a fundraising campaign that "
        "raised 212,000 pounds in eleven months.",
    ),
    (
        "Rewrite the following paragraph in the past tense. Keep every sentence, name and "
        "number; change only the verb tenses.",
        "Every morning at six, the ferry leaves the harbour at Port Ellis and crosses the strait "
        "to the island of Maren. The crossing takes forty minutes when the sea is calm and up to "
        "an hour when the wind comes from the west. Most passengers are workers from the fish "
        "processing plant on the island, who carry their lunch in metal boxes and sleep on the "
        "benches of the lower deck. The captain, a quiet woman named Ilse Varga, has worked on "
        "the route for nineteen years and knows every rock and current between the two coasts. "
        "On the upper deck a small cafe sells coffee, bread rolls and a thick fish soup that "
        "the regular passengers say is the best on the coast. In winter the ferry runs only "
        "twice a day, and when storms close the strait the island's school sends its children "
        "home early so that teachers who live on the mainland can catch the last boat. Once a "
        "month a doctor from Port Ellis travels across to hold a clinic in the village hall, "
        "where she sees between thirty and fifty patients in a single afternoon.",
    ),
    (
        "Rewrite the paragraph below in a formal, neutral tone suitable for an official report. "
        "Keep all facts, names, dates and figures exactly as given.",
        "So here's the deal with the Kestrel Road bridge: it's been falling apart for years and "
        "everybody knew it. Back in March 2021 an inspector named Paul Achterberg wrote that "
        "three of the steel bearings were badly rusted and that the deck had cracks up to four "
        "millimetres wide. The council basically sat on the report for fourteen months because "
        "it didn't have the 3.2 million euros the repairs were going to cost. Then in May 2022 a "
        "chunk of concrete fell off the underside and landed on a parked van, which finally got "
        "people moving. The bridge got shut to trucks over 7.5 tonnes the very next day, and "
        "buses were sent the long way round through Oudekerk, adding about twenty minutes to "
        "each trip. Repairs kicked off in September 2022 and wrapped up in August 2023, two "
        "months late and roughly 400,000 euros over budget. The council now says it'll inspect "
        "all of its nineteen bridges every two years instead of every five, and it has hired "
        "two extra engineers to make that happen.",
    ),
    (
        "Rewrite the following paragraph in plain English that a twelve-year-old can follow. "
        "Keep the names, numbers and the order of the events; keep sentences that are already "
        "simple as they are.",
        "The Lindqvist Observatory, situated at an elevation of 2,140 metres on the northern "
        "slope of Mount Tarrant, commenced scientific operations in 1964 following a protracted "
        "period of construction necessitated by the inaccessibility of the site. Its principal "
        "instrument, a reflecting telescope with a primary mirror 1.8 metres in diameter, was "
        "at that time among the largest in the southern hemisphere. During the subsequent "
        "decades the observatory's researchers contributed substantially to the cataloguing "
        "of variable stars, publishing measurements of more than 11,000 such objects. The "
        "deterioration of atmospheric conditions attributable to the expansion of the nearby "
        "city of Carrow, whose artificial illumination increasingly impeded observations, "
        "precipitated the relocation of the primary research programme to a remote site in "
        "1998. The original telescope was subsequently refurbished and now serves an "
        "educational function: approximately 9,000 schoolchildren visit the facility annually, "
        "and on clear evenings members of the public are permitted to observe the Moon and the "
        "planets through its eyepiece under the supervision of volunteer guides.",
    ),
    (
        "Rewrite the paragraph below in the first person, as if Dara Quinlan herself were "
        "telling it. Keep every detail, name and number.",
        "Dara Quinlan opened her bakery on Fenwick Street in October 2015 with two ovens, one "
        "employee and a loan of 30,000 dollars from her uncle. She got up at half past three "
        "every morning to start the sourdough, which needed twelve hours to rise, and she sold "
        "out of it by ten most days. In her first year she tried to sell cakes as well, but "
        "they went stale before anyone bought them, so she dropped them and concentrated on "
        "bread and pastries. In 2017 a food writer named Hollis Greer wrote a short piece about "
        "her rye loaf in the city paper, and the queue outside the shop the next Saturday went "
        "round the corner. She hired three more bakers that spring and bought a third oven, "
        "second-hand, from a hotel that was closing down. She paid back her uncle in full in "
        "2018. Today the bakery sells around 600 loaves a day, supplies bread to eleven "
        "restaurants, and runs a Sunday class where twelve people at a time learn to make "
        "sourdough at home. She still starts the first batch herself, although now at five.",
    ),
    (
        "Make the paragraph below gender-neutral: replace gendered words about people in general "
        "(chairman, he or she, manpower and the like) with neutral ones. Keep everything else "
        "word for word.",
        "Each member of the allotment society must pay his annual fee of 45 pounds before the "
        "first of April. A member who has not paid by then will receive a reminder from the "
        "chairman, and if he still has not paid by the first of May his plot will be offered to "
        "the next person on the waiting list. The society's committee consists of the chairman, "
        "the secretary, the treasurer and four ordinary members, each of whom is elected at the "
        "annual general meeting in November. The committee decides how the shared tools are "
        "used; a member who wishes to borrow the rotavator must book it with the tool steward "
        "at least two days in advance, and he is responsible for cleaning it before he returns "
        "it. Work days are held on the last Sunday of each month, and the committee asks every "
        "member to attend at least three of them a year, because the society does not have the "
        "manpower to maintain the paths and hedges otherwise. A member who cannot do heavy work "
        "may instead help the secretary with the newsletter or the seed swap in February.",
    ),
    (
        "Replace the British spellings in the paragraph below with American spellings (colour "
        "to color, organise to organize, centre to center and so on). Keep every other word.",
        "The Westmere Arts Centre will organise a weekend festival of colour and light on the "
        "12th and 13th of June. The programme includes a travelling exhibition of stained "
        "glass, a theatre workshop for children, and an evening parade in which local "
        "neighbourhood groups carry lanterns they have made themselves. Visitors are "
        "encouraged to travel by bus or bicycle, as the car park behind the centre holds only "
        "sixty vehicles; a cycle storage area with 200 spaces will be set up on the grassed "
        "area beside the main entrance. The organisers have catalogued more than 150 lanterns "
        "from previous years, and a selection of the favourite ones will be displayed in the "
        "foyer for the whole month. Catering will be provided by the Harbour Kitchen, which "
        "specialises in vegetarian dishes and will offer a flavoursome lentil stew and a "
        "yoghurt dessert at a subsidised price. Anyone who would like to volunteer as a steward "
        "should fill in the enrolment form at the reception desk; stewards will receive a "
        "free programme and a licence to park in the staff area.",
    ),
    (
        "Shorten the paragraph below by removing filler words and repetitions, but keep the "
        "original sentences and wording wherever possible, and keep all names and numbers.",
        "Basically, the annual survey of the Brannock Wetlands, which is really a very "
        "important survey, was carried out, as it is every single year, during the first two "
        "weeks of May by a team of fourteen volunteers who were led, as usual, by the ecologist "
        "Dr Yusuf Haddad. The team actually counted a total of 3,412 birds belonging to 58 "
        "different species, which is to say slightly more birds than the 3,150 birds that were "
        "counted in the previous year's survey. Of particular interest, and this is something "
        "the team was especially interested in, was the return of the bittern, a shy and "
        "secretive bird that had not been recorded at the wetlands at all since 2016. Two "
        "bitterns, in fact, were heard booming in the reed beds near the north pool on several "
        "different evenings. Dr Haddad said, and he said this quite clearly, that the return of "
        "the bittern was most likely due to the restoration work of 2021, in which roughly 4 "
        "hectares of reed bed were replanted and the water level was raised by about 30 "
        "centimetres. The full report will, it is expected, be published in September.",
    ),
]

# ---- extract fields to JSON ------------------------------------------------------------------

_EXTRACT = [
    (
        'Extract these fields from the job posting below and answer with JSON only: {"title", '
        '"company", "location", "salary_range", "hours_per_week", "start_date", "contact_email", '
        '"requirements" (a list of strings copied from the posting)}.',
        "Grevstad Marine Services is looking for a Senior Maintenance Technician to join its "
        "repair yard in Tromso, Norway. The successful candidate will service diesel engines, "
        "hydraulic winches and steering systems on fishing vessels between 15 and 60 metres "
        "long, and will supervise a team of three junior technicians. The position is full "
        "time, 37.5 hours per week, with occasional weekend call-outs that are paid at double "
        "rate. Salary: 610,000 to 680,000 NOK per year depending on experience, plus a housing "
        "allowance for the first twelve months. Requirements: a vocational certificate in marine "
        "engineering or equivalent; at least five years of experience with marine diesel "
        "engines; a valid driving licence; good spoken English or Norwegian. Experience with "
        "Caterpillar or Volvo Penta engines is an advantage. The start date is 1 March 2026 or "
        "by agreement. Applications, including a CV and two references, should be sent to "
        "recruitment@grevstad-marine.example by 15 January 2026. Questions about the role can "
        "be directed to the yard manager, Sigrid Holm, on +47 555 01 234 between 08:00 and "
        "15:00 on weekdays.",
    ),
    (
        'From the order confirmation below, output JSON only with the fields "order_number", '
        '"order_date", "customer_name", "shipping_address", "items" (a list of objects with '
        '"name", "quantity", "unit_price"), "shipping_cost", "total" and "payment_method".',
        "Thank you for your order, Mr. Tomasz Wrobel! Your order number is KB-2025-118734, "
        "placed on 14 November 2025 at 21:42. We will ship it to: Tomasz Wrobel, ul. Lipowa "
        "17/4, 30-702 Krakow, Poland. Your items: 2 x Oak Cutting Board, Large, at 34.90 EUR "
        "each; 1 x Cast Iron Skillet 28 cm at 49.00 EUR; 4 x Linen Tea Towel, Sage Green, at "
        "7.50 EUR each; 1 x Beeswax Food Wrap Set (3 pieces) at 12.95 EUR. Subtotal: 161.75 "
        "EUR. Shipping (standard, 3 to 5 working days): 6.90 EUR. Total charged: 168.65 EUR, "
        "paid by Visa ending in 4421. Please note that the skillet ships separately from our "
        "warehouse in Poznan, so you may receive two parcels. You can track both parcels on our "
        "website with your order number and the postcode of the shipping address. If anything "
        "is missing or damaged, reply to this email within 30 days and quote your order number; "
        "our customer service team answers from Monday to Friday, 9:00 to 17:00. Happy "
        "cooking from the team at Kitchenbarn!",
    ),
    (
        'Extract the following from the rental listing below as JSON only: "address", '
        '"monthly_rent", "deposit", "bedrooms", "bathrooms", "floor_area_m2", "available_from", '
        '"pets_allowed", "included_in_rent" (a list), "agent_name", "agent_phone".',
        "Bright two-bedroom flat to let at 42 Calloway Terrace, Leith, Edinburgh EH6 4QP. The "
        "flat is on the third floor of a 1900s tenement building with a shared garden and has "
        "been fully renovated this year. It has two double bedrooms, one bathroom with a "
        "shower over the bath, a separate kitchen with a gas hob and a washing machine, and a "
        "living room with a bay window overlooking the Water of Leith. Total floor area is 74 "
        "square metres. The rent is 1,350 pounds per calendar month, and a deposit of 1,500 "
        "pounds is required, held in a government-approved deposit scheme. The rent includes "
        "water rates, broadband up to 500 Mbps and a weekly cleaning of the common stair; "
        "tenants pay electricity, gas and council tax (band C). Sorry, no pets, as the building "
        "rules do not allow them. The flat is available from 1 February 2026 for a minimum "
        "lease of twelve months. Viewings are on Tuesday and Thursday evenings; to book one, "
        "call our agent Fiona MacRae on 0131 496 0721 or email lettings@forthhomes.example.",
    ),
    (
        'Read the bug report below and answer with JSON only: {"title", "reporter", '
        '"app_version", "os", "steps_to_reproduce" (a list of strings), "expected", "actual", '
        '"severity", "workaround"}.',
        "Title: Export to CSV drops rows with non-ASCII names. Reported by: Lena Hoffmann, 3 "
        "December 2025. App version: Ledgerly Desktop 4.12.1 (build 8817) on Windows 11 23H2. "
        "Steps to reproduce: 1. Open any workspace that has contacts with accented names, for "
        "example Jose Nunez or Zoe Muller written with their accents. 2. Go to Contacts and "
        "choose Export, then CSV. 3. Leave the encoding on the default setting and click Save. "
        "4. Open the exported file in a text editor. Expected result: every contact appears in "
        "the file, one per row, with the names spelled correctly. Actual result: contacts whose "
        "names contain non-ASCII characters are silently left out of the file; in my workspace "
        "37 of 412 contacts were missing and no warning was shown. Severity: high, because our "
        "accountant imports this file into the payroll system every month and did not notice "
        "the missing people. Workaround: choosing UTF-8 explicitly in the encoding drop-down "
        "before saving exports all rows correctly. The bug does not happen in version 4.11.3, "
        "so it seems to have been introduced by the last update.",
    ),
    (
        'From the event announcement below, output JSON only with "event_name", "date", '
        '"start_time", "end_time", "venue", "address", "speakers" (a list of objects with '
        '"name" and "affiliation"), "ticket_price", "registration_deadline" and "capacity".',
        "The Riverside Data Meetup returns for its autumn edition, Data Pipelines in Practice, "
        "on Thursday 23 October 2025, from 18:30 to 21:00, at the Old Tram Depot, 8 Quayside "
        "Lane, Bristol BS1 6RT. Doors open at 18:00 and pizza and soft drinks will be served "
        "from then on. This time we have three talks. Amara Nwosu, data engineer at Fernleaf "
        "Energy, will explain how her team moved from nightly batch jobs to streaming with a "
        "team of two people. Dr Felix Brandt from the University of the West will present his "
        "group's work on testing data pipelines with synthetic data. Finally, Priya "
        "Raghunathan, founder of the start-up Tidemark, will talk about what went wrong when "
        "they scaled their warehouse from ten gigabytes to ten terabytes. Tickets cost 5 "
        "pounds, which covers the food, and students attend for free. The venue holds 120 "
        "people and last time we sold out in four days, so please register before 16 October "
        "on our meetup page. The Old Tram Depot is step-free and has a hearing loop; if you "
        "have any other access needs, let the organisers know when you register.",
    ),
    (
        'Extract the patient intake details below as JSON only: {"patient_name", '
        '"date_of_birth", "visit_date", "reason_for_visit", "current_medications" (a list of '
        'objects with "name" and "dose"), "allergies" (a list), "blood_pressure", '
        '"heart_rate", "follow_up"}. (The record is fictional.)',
        "Clinic intake note, Ashgrove Family Practice, 9 September 2025. Patient: Marguerite "
        "Okafor, date of birth 2 July 1961. Reason for visit: persistent dry cough for about "
        "three weeks, worse at night, with no fever and no shortness of breath at rest. The "
        "patient reports that the cough started shortly after she began taking a new blood "
        "pressure medication in August. Current medications: lisinopril 10 mg once daily "
        "(started 4 August 2025), atorvastatin 20 mg once daily in the evening, and vitamin D "
        "1000 IU daily. Allergies: penicillin (rash) and shellfish. She does not smoke and "
        "drinks alcohol about twice a week. Observations today: blood pressure 138/86 mmHg, "
        "heart rate 72 beats per minute, temperature 36.8 degrees C, oxygen saturation 98 "
        "percent on room air. Chest clear on examination. Assessment: the cough is likely a "
        "side effect of lisinopril. Plan: stop lisinopril, start losartan 50 mg once daily "
        "instead, and review in four weeks, on 7 October 2025, with a blood pressure reading "
        "and a kidney function blood test one week before the review.",
    ),
    (
        'From the shipping notification below, output JSON only with "carrier", '
        '"tracking_number", "ship_date", "estimated_delivery", "origin", "destination", '
        '"package_count", "total_weight_kg", "service_level", "signature_required".',
        "Good news: your shipment is on its way. Sender: Alder and Finch Instruments Ltd, "
        "Unit 5, Marsh Lane Industrial Estate, Leeds LS10 1NB, United Kingdom. Recipient: "
        "Hanne Sorensen, Vestergade 21, 8000 Aarhus C, Denmark. Carrier: NordPost Express. "
        "Tracking number: NPX 7734 0092 1185 DK. The shipment left our warehouse on Monday 10 "
        "November 2025 and consists of 3 packages with a total weight of 18.4 kg. Service: "
        "International Priority, door to door. The estimated delivery date is Thursday 13 "
        "November 2025 between 09:00 and 17:00. A signature is required on delivery because "
        "the declared value of the contents, a restored cello and two bows, is above 1,000 "
        "euros. If nobody is home, the driver will leave a card and try again the next working "
        "day; after two failed attempts the packages will be held for ten days at the NordPost "
        "service point at Sondergade 4, Aarhus, where they can be collected with photo ID. "
        "Import duties have been prepaid by the sender, so nothing is due on delivery. For "
        "questions, call NordPost on +45 70 10 20 30 and quote your tracking number.",
    ),
    (
        'Extract from the meeting minutes below, as JSON only: "meeting", "date", "chair", '
        '"attendees" (a list), "apologies" (a list), "decisions" (a list of strings), '
        '"action_items" (a list of objects with "owner", "task", "due"), "next_meeting".',
        "Minutes of the Hollin Lane Residents' Association committee meeting, held on 4 "
        "November 2025 at 19:30 in the community room of St Bede's church. Chair: Rachel "
        "Adebayo. Present: Rachel Adebayo, Gordon Pike, Sunita Mehra, Callum Reid and Edith "
        "Barnes. Apologies: Tom Whitley and Yasmin Farah. 1. The minutes of the October meeting "
        "were approved without changes. 2. Street lighting: Gordon reported that the council "
        "has agreed to replace the four broken lamps on the footpath to the school before the "
        "end of November. 3. Winter fair: the committee decided to hold the fair on Saturday 6 "
        "December from 11:00 to 15:00 and to charge stallholders 10 pounds per table. Sunita "
        "will book the church hall by 10 November and Callum will design the poster by 14 "
        "November. 4. Treasurer's report: Edith reported a balance of 1,284.60 pounds. The "
        "committee decided to spend up to 150 pounds on new planters for the corner of Hollin "
        "Lane and Mill Street; Edith will order them by 30 November. 5. Any other business: "
        "none. The next meeting will be on Tuesday 2 December 2025 at 19:30 in the same room.",
    ),
]

# ---- edit a code snippet ---------------------------------------------------------------------

_CODE = [
    (
        "Add type hints to every function in the Python code below. Do not change anything "
        "else; answer with the complete code.",
        """import csv
from collections import defaultdict


def read_sales(path):
    rows = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            row["amount"] = float(row["amount"])
            rows.append(row)
    return rows


def total_by_region(rows):
    totals = defaultdict(float)
    for row in rows:
        totals[row["region"]] += row["amount"]
    return dict(totals)


def top_regions(totals, n=3):
    ranked = sorted(totals.items(), key=lambda item: item[1], reverse=True)
    return [region for region, _ in ranked[:n]]


def format_report(totals, top):
    lines = ["Sales by region:"]
    for region, amount in sorted(totals.items()):
        marker = " *" if region in top else ""
        lines.append(f"  {region}: {amount:.2f}{marker}")
    return "\\n".join(lines)


if __name__ == "__main__":
    sales = read_sales("sales.csv")
    totals = total_by_region(sales)
    print(format_report(totals, top_regions(totals)))
""",
    ),
    (
        "Rename the variable `lst` to `readings` and the function `proc` to `smooth_readings` "
        "everywhere in the code below. Answer with the complete code and nothing else.",
        """def proc(lst, window=5):
    \"\"\"Return the moving average of lst over the given window.\"\"\"
    if window < 1:
        raise ValueError("window must be at least 1")
    if len(lst) < window:
        return []
    out = []
    total = sum(lst[:window])
    out.append(total / window)
    for i in range(window, len(lst)):
        total += lst[i] - lst[i - window]
        out.append(total / window)
    return out


def peaks(lst, threshold):
    smoothed = proc(lst)
    result = []
    for i in range(1, len(smoothed) - 1):
        if smoothed[i] > threshold and smoothed[i - 1] < smoothed[i] > smoothed[i + 1]:
            result.append(i)
    return result


def summary(lst):
    smoothed = proc(lst, window=3)
    return {
        "count": len(lst),
        "min": min(lst),
        "max": max(lst),
        "smoothed_max": max(smoothed) if smoothed else None,
    }
""",
    ),
    (
        "The function below has a bug: `median` gives the wrong answer for lists of even "
        "length. Fix it, and answer with the complete corrected code.",
        """def mean(values):
    if not values:
        raise ValueError("mean of an empty list")
    return sum(values) / len(values)


def median(values):
    if not values:
        raise ValueError("median of an empty list")
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle]


def variance(values):
    m = mean(values)
    return sum((v - m) ** 2 for v in values) / len(values)


def describe(values):
    return {
        "n": len(values),
        "mean": round(mean(values), 3),
        "median": round(median(values), 3),
        "variance": round(variance(values), 3),
        "min": min(values),
        "max": max(values),
    }


if __name__ == "__main__":
    print(describe([4, 8, 15, 16, 23, 42]))
    print(describe([2.5, 3.5, 1.0]))
""",
    ),
    (
        "Add a short docstring to each function in the JavaScript code below (JSDoc style, one "
        "line each). Keep the code itself exactly the same and answer with the complete code.",
        """function parseDuration(text) {
  const match = /^(\\d+)(ms|s|m|h)$/.exec(text.trim());
  if (!match) {
    throw new Error(`invalid duration: ${text}`);
  }
  const value = Number(match[1]);
  const unit = match[2];
  const factors = { ms: 1, s: 1000, m: 60000, h: 3600000 };
  return value * factors[unit];
}

function formatDuration(ms) {
  if (ms < 1000) {
    return `${ms}ms`;
  }
  if (ms < 60000) {
    return `${(ms / 1000).toFixed(1)}s`;
  }
  const minutes = Math.floor(ms / 60000);
  const seconds = Math.round((ms % 60000) / 1000);
  return `${minutes}m ${seconds}s`;
}

function withTimeout(promise, text) {
  const ms = parseDuration(text);
  return Promise.race([
    promise,
    new Promise((_, reject) =>
      setTimeout(() => reject(new Error(`timed out after ${formatDuration(ms)}`)), ms)
    ),
  ]);
}

module.exports = { parseDuration, formatDuration, withTimeout };
""",
    ),
    (
        "Rewrite the loops in the Python code below as list or dict comprehensions where that "
        "is possible, and keep everything else unchanged. Answer with the complete code.",
        """def normalize_names(names):
    result = []
    for name in names:
        result.append(name.strip().title())
    return result


def index_by_id(users):
    index = {}
    for user in users:
        index[user["id"]] = user
    return index


def active_emails(users):
    emails = []
    for user in users:
        if user["active"] and user.get("email"):
            emails.append(user["email"].lower())
    return emails


def group_sizes(users):
    sizes = {}
    for user in users:
        group = user.get("group", "none")
        sizes[group] = sizes.get(group, 0) + 1
    return sizes


USERS = [
    {"id": 1, "name": " ada lovelace ", "email": "Ada@Example.org", "active": True, "group": "a"},
    {"id": 2, "name": "alan turing", "email": None, "active": True, "group": "b"},
    {"id": 3, "name": "grace hopper", "email": "grace@example.org", "active": False},
]
""",
    ),
    (
        "Add logging to the Python code below: create a module-level logger with "
        "`logging.getLogger(__name__)`, log a warning where a retry happens and an error before "
        "the final exception is raised. Keep everything else as it is; answer with the complete "
        "code.",
        """import time

import requests


class FetchError(Exception):
    pass


def fetch_json(url, retries=3, backoff=0.5, timeout=10):
    last_error = None
    for attempt in range(1, retries + 1):
        try:
            response = requests.get(url, timeout=timeout)
            response.raise_for_status()
            return response.json()
        except requests.RequestException as exc:
            last_error = exc
            if attempt < retries:
                time.sleep(backoff * 2 ** (attempt - 1))
    raise FetchError(f"could not fetch {url} after {retries} attempts") from last_error


def fetch_all(urls):
    results = {}
    for url in urls:
        try:
            results[url] = fetch_json(url)
        except FetchError:
            results[url] = None
    return results
""",
    ),
    (
        "Convert the Python class below into a `@dataclass` (from the dataclasses module), "
        "removing the hand-written `__init__` and `__repr__`. Keep the methods unchanged and "
        "answer with the complete code.",
        """class InventoryItem:
    def __init__(self, sku, name, unit_price, quantity=0, tags=None):
        self.sku = sku
        self.name = name
        self.unit_price = unit_price
        self.quantity = quantity
        self.tags = tags if tags is not None else []

    def __repr__(self):
        return (
            f"InventoryItem(sku={self.sku!r}, name={self.name!r}, "
            f"unit_price={self.unit_price!r}, quantity={self.quantity!r}, tags={self.tags!r})"
        )

    def total_value(self):
        return self.unit_price * self.quantity

    def restock(self, amount):
        if amount <= 0:
            raise ValueError("restock amount must be positive")
        self.quantity += amount

    def sell(self, amount):
        if amount > self.quantity:
            raise ValueError(f"only {self.quantity} of {self.sku} in stock")
        self.quantity -= amount
        return self.unit_price * amount

    def has_tag(self, tag):
        return tag.lower() in (t.lower() for t in self.tags)
""",
    ),
    (
        "In the SQL below, rename the table `orders` to `customer_orders` and the column "
        "`amt` to `amount` everywhere, and change nothing else. Answer with the complete SQL.",
        """CREATE TABLE orders (
    id          INTEGER PRIMARY KEY,
    customer_id INTEGER NOT NULL REFERENCES customers (id),
    placed_at   TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP,
    status      TEXT NOT NULL DEFAULT 'open',
    amt         NUMERIC(10, 2) NOT NULL CHECK (amt >= 0)
);

CREATE INDEX orders_customer_idx ON orders (customer_id, placed_at);

-- monthly revenue per customer, closed orders only
SELECT c.name,
       date_trunc('month', o.placed_at) AS month,
       SUM(o.amt) AS revenue,
       COUNT(*) AS order_count
FROM orders o
JOIN customers c ON c.id = o.customer_id
WHERE o.status = 'closed'
GROUP BY c.name, date_trunc('month', o.placed_at)
ORDER BY month, revenue DESC;

-- customers whose average order is above 100
SELECT customer_id, AVG(amt) AS avg_amt
FROM orders
GROUP BY customer_id
HAVING AVG(amt) > 100;
""",
    ),
]

# ---- summarize with quotes -------------------------------------------------------------------

_QUOTE = (
    "Summarize the passage below in three or four sentences. Include at least two quotations "
    "copied word for word from the passage, in quotation marks."
)
_SUMMARIZE = [
    (
        _QUOTE,
        "At a council meeting on Tuesday, the mayor of Dunmore, Celia Ashworth, announced that "
        "the town's central square will be closed to cars from next spring. \"For forty years "
        'we have given the best space in this town to parked vehicles," she said. "It is time '
        'we gave it back to people." Under the plan, the 86 parking spaces in the square will '
        "be replaced by trees, benches and a covered area for the Saturday market, which "
        "currently has to squeeze its stalls between the cars. A new car park with 120 spaces "
        "will open on the site of the old bus depot, a five-minute walk away. Not everyone is "
        "pleased. Owen Pritchard, who runs a hardware shop on the square, said his older "
        'customers would struggle. "People buying paint and timber are not going to carry it '
        'five minutes down the road," he said. The council has promised a loading bay and '
        "twenty minutes of free parking for shop deliveries and collections. Work is expected "
        "to cost 1.9 million pounds, most of it from a regional grant, and to take seven "
        "months.",
    ),
    (
        _QUOTE,
        "In an interview with the Coastal Review, the marine biologist Dr Noor Haddadin "
        "described the first results of a three-year study of the kelp forests off the Calder "
        "Peninsula. Her team found that the forests had shrunk by about 40 percent since 2015, "
        "mostly because sea urchins, whose numbers had exploded after a disease killed most of "
        'the sunflower sea stars that eat them, had grazed the kelp down to bare rock. "You '
        'swim out over what used to be a forest and it is like a desert with spikes," she '
        "said. The team also tested a restoration method in which volunteer divers remove "
        "urchins by hand from small patches of reef. In the six test patches, kelp grew back "
        'within eighteen months. "It works, but it is slow, and the reef is enormous," '
        'Haddadin said. "We cleared about two hectares. The area we lost is closer to two '
        'thousand." The team now wants to combine hand removal with a programme to breed and '
        "release sunflower sea stars, which a hatchery in the north has started raising.",
    ),
    (
        _QUOTE,
        "The board of the Millbrook Water Cooperative met on 18 September to discuss the "
        "results of the summer's leak survey. The survey, carried out by the engineering firm "
        "Pollard and Kemp, found 23 leaks in the cooperative's 64 kilometres of pipe, losing an "
        "estimated 310 cubic metres of water a day, roughly a fifth of what the cooperative "
        'pumps. "We have been paying to treat and pump water that goes straight back into the '
        'ground," said the treasurer, Abena Mensah. The chair, Robert Lindqvist, proposed '
        "fixing the eight largest leaks immediately, at a cost of about 95,000 dollars, and "
        'replacing the oldest 5 kilometres of cast iron pipe over the next three years. "If we '
        'do nothing, the leaks will only get bigger, and the bill with them," he said. After '
        "a long discussion the board approved the immediate repairs but asked for two more "
        "quotes before deciding on the pipe replacement. Members will be asked to vote on a "
        "rate increase of 4 percent at the annual meeting in November.",
    ),
    (
        _QUOTE,
        "Speaking at the opening of the new Aldgate Maker Library on Saturday, the architect "
        "Tomas Ferreira explained why the building looks unfinished. The library, which lends "
        "tools, sewing machines and 3D printers instead of books, occupies a former tyre "
        "warehouse, and Ferreira's team kept its concrete floor, steel columns and even the "
        'painted lane markings. "We did not want to make it precious," he said. "People '
        'come here to saw things and spill glue. The building has to be able to take it." The '
        "conversion cost 780,000 pounds, about half of what a new building of the same size "
        "would have cost, and took eleven months. The library already has 1,400 members, who "
        "pay 25 pounds a year, and more than 900 items to lend. The head librarian, Joy "
        "Nakamura, said the most borrowed item in the trial months was not a 3D printer but a "
        'carpet cleaner. "Everyone needs one twice a year, and nobody wants to store one," '
        "she said. Evening workshops on bicycle repair and furniture restoration start next "
        "month.",
    ),
    (
        _QUOTE,
        "The Fairhaven Hospital trust has published its review of last winter, when waiting "
        "times in the emergency department reached a record average of six hours and forty "
        "minutes in January. The review, led by the former chief nurse Margaret Olsen, found "
        "that the main cause was not the number of patients arriving, which was only 4 percent "
        "higher than the year before, but the number who could not leave. On a typical day in "
        "January, 71 patients who were medically fit to go home were still in hospital beds "
        'because no care at home or in a care home was available for them. "The emergency '
        'department was the place where the problem showed, not the place where it started," '
        "the review says. It recommends that the trust pay for 40 short-term places in local "
        "care homes every winter and set up a discharge team that works seven days a week. "
        "The trust's chief executive, Daniel Obi, said he accepted every recommendation. \"We "
        'will not go into another winter with the same plan and expect a different result," '
        "he said.",
    ),
    (
        _QUOTE,
        "Farmers in the Vell valley say the new irrigation scheme has changed what they can "
        "grow. Until three years ago, most farms in the valley depended on rain and grew "
        "wheat and barley, which tolerate dry summers. Since the scheme began delivering water "
        "from the Vell reservoir through 38 kilometres of buried pipes, about a third of the "
        'farms have started growing vegetables and soft fruit. "My grandfather would not '
        'believe there are strawberries on this hill," said Ines Carvalho, whose family has '
        "farmed near the village of Soure for four generations. Each farm pays for the water "
        "it uses through a meter, at 0.18 euros per cubic metre. The scheme's manager, Rui "
        'Tavares, warned that the reservoir is not unlimited. "In a dry year we will have to '
        'ration, and the farms that planted thirsty crops will feel it first," he said. The '
        "scheme cost 27 million euros, of which 60 percent came from a European fund, and it "
        "now serves 212 farms.",
    ),
    (
        _QUOTE,
        "The chess club at Brookfield Secondary School has won the national schools "
        "championship for the first time, beating the defending champions, St Aidan's "
        "College, by four and a half points to three and a half in the final in Manchester on "
        "Sunday. The deciding game was played on board eight by thirteen-year-old Kofi "
        'Asante, who had joined the club only eighteen months ago. "I was sure I was losing '
        'for the whole middle of the game," he said afterwards. "Then he moved his queen too '
        'early and I saw the knight fork." The club was founded six years ago by the maths '
        "teacher Helen Strand, who started it with five pupils and a box of second-hand sets "
        "in her classroom at lunchtime. It now has 46 members and meets three times a week. "
        '"They don\'t win because they are geniuses," Strand said. "They win because they '
        'turn up every week and go over every game they lose." The team will represent the '
        "country at the European schools tournament in Riga in April.",
    ),
    (
        _QUOTE,
        "A report by the transport researcher Dr Lena Vogt on the city's first year of free "
        "bus travel for under-25s has found that the scheme roughly doubled the number of bus "
        "journeys made by young people, from 2.1 million to 4.3 million. Most of the new "
        "journeys were short trips in the evening and at weekends, to work, sport and "
        'friends, rather than school runs, which were already free. "The scheme did not so '
        'much replace car trips as create trips that were not being made at all," the report '
        "says. Car journeys by young drivers fell by only 6 percent. Vogt said that was not a "
        'failure. "If a seventeen-year-old can now get to a weekend job that was out of reach '
        'before, that is the point," she said. The scheme cost the city 8.4 million euros, '
        "about 1.95 euros per extra journey. The report recommends keeping it and adding more "
        "late buses on the routes to the industrial estate, where evening services are often "
        "so full that passengers are left at the stop.",
    ),
]

# ---- open chat --------------------------------------------------------------------------------

_CHAT = [
    "What are some good habits for keeping a houseplant alive?",
    "Explain why the sky is blue to someone who has never studied physics.",
    "Give me a simple plan for learning to cook ten basic dishes in a month.",
    "What should I think about before adopting a dog?",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "How does a bicycle stay upright while it is moving?",
]


def _grounded() -> list[Prompt]:
    """The four kinds interleaved (rewrite-0, extract-0, code-0, summarize-0, rewrite-1, ...):
    any first n prompts spread over the kinds."""
    by_kind = {"rewrite": _REWRITE, "extract": _EXTRACT, "code": _CODE, "summarize": _SUMMARIZE}
    out = []
    for i in range(max(len(v) for v in by_kind.values())):
        for kind in GROUNDED_KINDS:
            if i < len(by_kind[kind]):
                instruction, passage = by_kind[kind][i]
                out.append(Prompt(f"{kind}-{i}", kind, f"{instruction}\n\n{passage}"))
    return out


GROUNDED: list[Prompt] = _grounded()
CHAT: list[Prompt] = [Prompt(f"chat-{i}", "chat", text) for i, text in enumerate(_CHAT)]
WORKLOADS: dict[str, list[Prompt]] = {"grounded": GROUNDED, "chat": CHAT}
