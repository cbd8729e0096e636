"""Generator of the shipped English corpus ``moe_train/assets/corpus.txt``.

The smoke test trains a byte-level model on real-looking English prose. So that the kit owns every
sentence it ships, the text is generated here, deterministically (``random.Random(SEED)``, stdlib
only), from a small phrase-structure grammar: shared sentence patterns (narration, description,
cause and effect, reported speech, instructions, dialogue) filled from per-topic word lists
(weather, cooking, trains, a cluster of machines, experts routing tokens, gardens, ...).

    python -m moe_train.corpus            # (re)write moe_train/assets/corpus.txt
    python -m moe_train.corpus --check    # exit 1 if the shipped file differs from the generator
    python -m moe_train.corpus --out PATH # write elsewhere
"""

from __future__ import annotations

import argparse
import random
import re
import sys
from pathlib import Path

SEED = 20240611
TARGET_BYTES = 420_000
DEFAULT_OUT = Path(__file__).resolve().parent / "assets" / "corpus.txt"

# ---------------------------------------------------------------------------------------------
# Morphology


def plural(noun: str) -> str:
    if "/" in noun:
        return noun.split("/", 1)[1]
    if re.search(r"(s|x|z|ch|sh)$", noun):
        return noun + "es"
    if re.search(r"[^aeiou]y$", noun):
        return noun[:-1] + "ies"
    return noun + "s"


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
    if form == "past":
        if past:
            return past
        if base.endswith("e"):
            return base + "d"
        if re.search(r"[^aeiou]y$", base):
            return base[:-1] + "ied"
        return base + "ed"
    if base == "have":
        return "has"
    if re.search(r"(s|x|z|ch|sh|o)$", base):
        return base + "es"
    if re.search(r"[^aeiou]y$", base):
        return base[:-1] + "ies"
    return base + "s"


def conjugate(text: str, form: str) -> str:
    """Conjugate every ``<base/past>`` marker in ``text``."""
    return re.sub(r"<([^<>]+)>", lambda m: verb_form(m.group(1), form), text)


def capitalize(s: str) -> str:
    for i, ch in enumerate(s):
        if ch.isalpha():
            return s[:i] + ch.upper() + s[i + 1:]
    return s


NUMBER_WORDS = ("two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                "twelve")

# ---------------------------------------------------------------------------------------------
# Shared vocabulary

NAMES = ("Maria Tomas Aiko Jonas Priya Samuel Lena Omar Greta Felix Nadia Hugo Ines Victor Mei "
         "Daniel Rosa Kofi Elena Arjun Clara Mateo Yusuf Hanna Leo Amara Oskar Sofia Ravi Ida "
         "Pablo Noor Emil Zara Theo Lucia Marcus Anya Idris Julia Bruno Keiko Simon Farah Nils "
         "Alma Diego Vera Kenji Nora Adrian Leila Marta Ezra Dora Wendell Isla Tariq Petra José Zoë "
         "Søren Chloé Björn Renée").split()
FAMILY = "aunt uncle sister brother cousin grandfather grandmother neighbor friend father mother".split()
DAYS = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()
MONTHS = ("January February March April May June July August September October November "
          "December").split()
DIRECTIONS = "north south east west northwest southwest northeast southeast".split()

PAST_TIMES = ("On {day}", "Last {day}", "Early in the morning", "After lunch", "By noon",
              "Later that evening", "In {month}", "At {clock}", "The next morning",
              "Just before dark", "That afternoon", "A week later", "On the first day",
              "Around midnight", "Two days later", "At the end of {month}", "Before breakfast",
              "Some time after {clock}", "The following {day}", "Years ago")
PRESENT_TIMES = ("Every morning", "On most days", "In winter", "In summer", "Usually",
                 "Once a week", "Most evenings", "On {day}s", "In early {month}", "Sometimes",
                 "Every few days", "In the spring", "After a long day", "Often",
                 "Twice a month", "On cold nights", "At the start of each week")
ADVERBS = ("slowly", "carefully", "quickly", "again", "quietly", "at once", "without a word",
           "with some care", "as usual", "for the first time", "in silence", "once more",
           "with great patience", "a little too fast", "by hand", "twice")
FEELINGS = ("glad", "tired", "surprised", "curious", "relieved", "worried", "pleased", "calm",
            "uneasy", "proud", "hopeful", "annoyed", "puzzled", "happy")
REPORT = ("<say/said>", "<think/thought>", "<notice/noticed>", "<explain/explained>",
          "<write/wrote>", "<remember/remembered>", "<point/pointed> out", "<suggest/suggested>",
          "<mention/mentioned>", "<believe/believed>", "<hear/heard>", "<find/found> out")
CATENATIVES = ("<want/wanted> to", "<need/needed> to", "<try/tried> to", "<decide/decided> to",
               "<forget/forgot> to", "<plan/planned> to", "<hope/hoped> to", "<like/liked> to",
               "<remember/remembered> to", "<start/started> to", "<promise/promised> to",
               "<offer/offered> to", "<prefer/preferred> to", "<learn/learned> to")
BIG_NUMBERS = (120, 250, 400, 600, 800, 1200, 1500, 2000, 3000, 5000, 8000, 12000)
MINUTES = ("00", "05", "10", "15", "20", "30", "40", "45", "50")
DAY_ADJS = ("long", "quiet", "busy", "strange", "ordinary", "slow", "good", "lucky", "tiring",
            "peaceful", "hard")
DURATIONS = ("{n} minutes", "{few} hours", "{n} days", "half an hour", "a whole afternoon",
             "most of the morning")
CONTRASTS = ("but", "yet", "although", "even though")
ANSWERS = ("Yes, of course.", "No, not yet.", "I am not sure.", "Maybe after lunch.",
           "I think so.", "Not today.", "Only a few.", "Ask {name}, not me.", "Give me {n} minutes.",
           "It depends on the weather.", "Yes, but only once.", "Not since {day}.",
           "I hope so.", "Probably, but let us check first.", "Almost.", "Nobody knows.")
SPEECH_VERBS = ("said", "replied", "answered", "added", "explained", "called", "whispered",
                "admitted", "agreed", "murmured")

# ---------------------------------------------------------------------------------------------
# Topics. Lists of single words are written space-separated ("_" stands for a space inside a
# word; "sg/pl" gives an irregular plural). Verb phrases mark verbs as <base/past>. Events are
# "subject|verb phrase", with "+" after a plural subject. Templates use {slots} (see _slot).

TOPICS: dict[str, dict] = {}


def topic(name: str, **fields) -> None:
    TOPICS[name] = fields


topic(
    "weather",
    titles=["A week of {adj} weather", "Notes on the weather", "The storm of {month}",
            "Fog on the coast", "A diary of rain"],
    people="forecaster farmer pilot sailor ferry_captain shepherd schoolteacher weather_observer "
           "lighthouse_keeper postman/postmen".split(),
    things="cloud storm gust puddle umbrella raincoat thermometer barometer forecast window "
           "rooftop hailstone snowflake rainbow breeze hill field chimney weather_vane "
           "rain_gauge shutter".split(),
    stuff="rain fog snow mist sunshine drizzle frost hail thunder wind air ice".split(),
    adjs="cold warm gray damp dry windy bright heavy still humid clear dark gentle sudden steady "
         "chilly mild low soft bitter".split(),
    acts=["<check/checked> the barometer twice", "<read/read> the forecast aloud",
          "<close/closed> the shutters before the storm", "<hang/hung> the washing on the line",
          "<carry/carried> an umbrella to work", "<measure/measured> {n} millimeters of rain",
          "<watch/watched> the clouds over the hills", "<write/wrote> down the temperature",
          "<wait/waited> for the rain to stop", "<cover/covered> the young plants against the frost",
          "<walk/walked> home through the drizzle", "<open/opened> the windows to let in the air",
          "<clear/cleared> the snow from the path", "<record/recorded> a low of {n} degrees",
          "<empty/emptied> the rain gauge", "<put/put> on a thick wool coat",
          "<tie/tied> down the chairs on the porch", "<listen/listened> to the thunder"],
    events=["the wind|<pick/picked> up in the afternoon", "the temperature|<drop/dropped> to {n} degrees",
            "the fog|<lift/lifted> slowly from the valley", "heavy clouds+|<gather/gathered> over the hills",
            "the rain|<turn/turned> to snow after dark", "the storm|<pass/passed> to the {dir}",
            "the sun|<break/broke> through around noon", "a cold front|<move/moved> in from the {dir}",
            "the puddles+|<freeze/froze> overnight", "the river|<rise/rose> after days of rain",
            "the air|<feel/felt> heavy and still", "thunder|<roll/rolled> across the valley",
            "the first snow|<fall/fell> on the hills", "a thin mist|<hang/hung> over the fields",
            "the sky|<clear/cleared> by evening", "hailstones+|<bounce/bounced> off the roof"],
    places=["over the hills", "along the coast", "in the valley", "above the town",
            "on the north side of the island", "near the harbor", "across the plain",
            "in the city", "by the lighthouse", "on the high road"],
    units=["{n} degrees", "{n} millimeters of rain", "{n} kilometers an hour", "{pct} percent humidity"],
    facts=["Fog forms when warm, damp air cools over cold ground.",
           "A falling barometer often means that rain is on the way.",
           "In {month}, the average temperature here is about {n} degrees.",
           "The wind usually comes from the {dir}, except in late summer.",
           "Snow is rare on the coast, but the hills see it most winters.",
           "A ring around the moon is an old sign of rain.",
           "The forecast gives a {pct} percent chance of showers for {day}.",
           "Dry air warms quickly in the morning and cools quickly at night.",
           "Thunder follows lightning because sound travels much more slowly than light.",
           "On clear nights the ground loses its heat to the open sky.",
           "A steady rain is better for the fields than a sudden storm.",
           "The coldest hour of the day is often just before sunrise.",
           "Gusts of {unit} are expected near the coast.",
           "Most of the rain falls between {month} and {month}."],
    lines=["It looks like rain again.", "Did you bring an umbrella?",
           "The wind is too strong for the ferry today.", "I think the fog will lift by noon.",
           "It was {n} degrees this morning.", "We should bring the chairs inside before the storm.",
           "Look at those clouds over the hills.", "The forecast was wrong again.",
           "I like the sound of rain on the roof.", "Is it still snowing?",
           "The roads will be icy tonight.", "Close the window, the draft is cold."],
)

topic(
    "kitchen",
    titles=["Soup for a cold evening", "Notes from the kitchen", "How {name} bakes bread",
            "A dinner for {few}", "The {adj} oven"],
    people="cook baker chef guest host kitchen_porter grocer".split(),
    things="onion carrot potato/potatoes pan pot knife/knives spoon bowl loaf/loaves oven lid tray recipe "
           "cutting_board apple lemon egg jar kettle plate tomato/tomatoes pepper".split(),
    stuff="flour butter salt sugar soup rice oil dough garlic cream broth yeast honey "
          "pepper_sauce".split(),
    adjs="hot fresh crisp sweet salty soft sharp thick golden warm ripe bitter smooth heavy "
         "clean spicy".split(),
    acts=["<chop/chopped> the onions into small pieces", "<stir/stirred> the soup with a wooden spoon",
          "<knead/kneaded> the dough for {n} minutes", "<heat/heated> the oil in a heavy pan",
          "<peel/peeled> {few} potatoes", "<taste/tasted> the broth and <add/added> more salt",
          "<set/set> the table for {few} guests", "<wash/washed> the bowls by hand",
          "<slice/sliced> the bread while it was still warm", "<boil/boiled> the eggs for {n} minutes",
          "<grate/grated> a little lemon peel over the fish", "<bake/baked> {few} loaves before sunrise",
          "<roast/roasted> the carrots with garlic and oil", "<melt/melted> the butter over a low flame",
          "<pour/poured> the cream into a small jug", "<weigh/weighed> out {n}0 grams of flour",
          "<cover/covered> the bowl with a clean cloth", "<sharpen/sharpened> the old knife"],
    events=["the dough|<rise/rose> in a warm corner", "the kettle|<whistle/whistled> on the stove",
            "the bread|<come/came> out golden and crisp", "the soup|<simmer/simmered> for an hour",
            "the onions+|<turn/turned> soft and sweet", "the kitchen|<smell/smelled> of garlic",
            "the butter|<melt/melted> too quickly", "the rice|<stick/stuck> to the bottom of the pot",
            "the oven|<take/took> a long time to heat", "the guests+|<arrive/arrived> hungry",
            "the sauce|<thicken/thickened> as it cooled", "the milk|<boil/boiled> over"],
    places=["in the kitchen", "on the stove", "near the oven", "at the long table",
            "in the pantry", "by the sink", "on the counter", "in the cellar"],
    units=["{n} minutes", "{n}0 grams", "{n} degrees", "{few} cups"],
    facts=["A good loaf needs about {n} minutes in a hot oven.",
           "Salt brings out the flavor of almost every dish.",
           "Onions soften faster when the pan is covered.",
           "Bread dough rises best in a warm, quiet place.",
           "A sharp knife/knives is safer than a dull one, because it does not slip.",
           "Soup often tastes better on the second day.",
           "Rice needs about twice its volume of water.",
           "Cold butter makes a flaky crust, and soft butter makes a tender cake.",
           "The recipe calls for {few} eggs and {n}0 grams of sugar.",
           "Lemon juice keeps cut apples from turning brown.",
           "A heavy pan holds its heat and cooks more evenly.",
           "Most sauces thicken as they cool."],
    lines=["Is the bread ready yet?", "Pass me the salt, please.", "This soup needs more pepper.",
           "Who left the lid off the pot?", "Dinner will be ready in {n} minutes.",
           "Do we have any eggs left?", "The oven is still too cold.",
           "I burned the first batch again.", "Try a piece of this, it is still warm.",
           "How much flour do we need?", "Wash your hands before you touch the dough."],
)

topic(
    "trains",
    titles=["The night train", "A journey to the coast", "Waiting on platform {n}",
            "The timetable of {month}", "The last train home"],
    people="conductor driver passenger station_master porter ticket_inspector traveler "
           "signal_operator".split(),
    things="train platform carriage ticket timetable signal track bench clock suitcase tunnel "
           "bridge station window seat whistle lantern engine timetable_board".split(),
    stuff="steam luggage coffee noise smoke rain light".split(),
    adjs="late early crowded empty long quiet noisy slow fast old narrow cold warm busy "
         "sleepy punctual".split(),
    acts=["<buy/bought> a ticket at the window", "<check/checked> the timetable twice",
          "<carry/carried> a heavy suitcase up the stairs", "<wait/waited> on platform {n}",
          "<wave/waved> a green flag", "<find/found> a seat by the window",
          "<read/read> a newspaper until the next stop", "<sleep/slept> through the tunnel",
          "<miss/missed> the {clock} train", "<change/changed> trains at the junction",
          "<punch/punched> every ticket in the carriage", "<sound/sounded> the whistle",
          "<announce/announced> a delay of {n} minutes", "<count/counted> the stations to the coast",
          "<drink/drank> coffee from a paper cup", "<lift/lifted> the bags onto the rack",
          "<look/looked> out at the passing fields", "<ask/asked> the porter for directions"],
    events=["the train|<leave/left> at {clock}", "the night train|<arrive/arrived> {n} minutes late",
            "the carriage|<rock/rocked> gently from side to side", "the signal|<turn/turned> green",
            "the platform|<fill/filled> with passengers", "the engine|<slow/slowed> near the bridge",
            "the lights+|<flicker/flickered> in the tunnel", "the doors+|<close/closed> with a hiss",
            "the station clock|<strike/struck> {few}", "the express|<rush/rushed> past without stopping",
            "the rails+|<shine/shone> in the rain", "the whistle|<echo/echoed> across the valley"],
    places=["on the platform", "in the first carriage", "at the junction", "by the ticket office",
            "under the station clock", "near the level crossing", "in the waiting room",
            "on the night train", "at the end of the line"],
    units=["{n} minutes", "{n} stations", "{big} kilometers", "{n} carriages"],
    facts=["The first train leaves at {clock} and the last one just before midnight.",
           "The line to the coast has {n} stations and {few} long tunnels.",
           "A return ticket costs less than two single tickets.",
           "The night train takes about {n} hours to cross the country.",
           "Freight trains run mostly at night, when the line is quiet.",
           "The old station was built of red brick and has a glass roof.",
           "Signals along the line keep two trains from using the same section of track.",
           "On weekdays the trains run every {n} minutes.",
           "The journey covers about {big} kilometers.",
           "Passengers with bicycles travel in the last carriage."],
    lines=["Is this seat taken?", "The train is late again.", "Which platform for the coast?",
           "We change at the junction.", "Tickets, please.", "Did you hear the announcement?",
           "There is a delay of {n} minutes.", "I always sleep on the night train.",
           "Wake me up at the next station.", "This carriage is much too warm.",
           "We should have taken the earlier train."],
)

topic(
    "cluster",
    titles=["A night on call", "The new racks", "Notes on the cluster", "When node {n} failed",
            "Moving {few} hundred jobs"],
    people="operator administrator engineer technician researcher scheduler_maintainer "
           "on-call_engineer".split(),
    things="machine rack node server cable fan disk switch job queue log dashboard alert "
           "power_supply network_card checkpoint process accelerator sensor".split(),
    stuff="heat memory bandwidth traffic power storage noise".split(),
    adjs="idle busy hot quiet slow fast new old healthy broken loud full empty stable "
         "overloaded".split(),
    acts=["<restart/restarted> the failed node", "<replace/replaced> a broken fan",
          "<check/checked> the logs for errors", "<move/moved> {n} jobs to another queue",
          "<drain/drained> the rack before the upgrade", "<label/labeled> every cable",
          "<watch/watched> the dashboard all night", "<write/wrote> a short report on the outage",
          "<update/updated> the drivers on {n} machines", "<swap/swapped> a failing disk",
          "<measure/measured> the temperature of each rack", "<clean/cleaned> the dust from the filters",
          "<test/tested> the network between the racks", "<reboot/rebooted> the switch",
          "<add/added> {n} new nodes to the cluster", "<silence/silenced> a noisy alert",
          "<save/saved> a checkpoint every hour", "<count/counted> the idle machines"],
    events=["a power supply|<fail/failed> in rack {n}", "the fans+|<spin/spun> up under load",
            "the queue|<grow/grew> to {big} jobs", "the temperature|<rise/rose> in the cold aisle",
            "a node|<stop/stopped> answering", "the network|<slow/slowed> down at midnight",
            "the job|<crash/crashed> after {n} hours", "the alerts+|<go/went> quiet",
            "the checkpoint|<finish/finished> writing", "the disks+|<fill/filled> up",
            "the cluster|<run/ran> at full load", "the new switch|<arrive/arrived> on {day}"],
    places=["in the machine room", "in rack {n}", "on the second floor", "in the cold aisle",
            "behind the main switch", "in the scheduler logs", "on the dashboard",
            "across the whole cluster"],
    units=["{n} nodes", "{big} jobs", "{n} gigabytes", "{n} degrees", "{n} hours"],
    facts=["Each rack holds {n} machines and two network switches.",
           "A job that runs for days should save a checkpoint every hour.",
           "Hot air leaves the back of the machines and rises toward the ceiling.",
           "The scheduler gives each job the nodes it asks for, or makes it wait.",
           "Most failures start with a small warning in the logs.",
           "A single slow node can hold back a job that uses {few} hundred machines.",
           "The cluster uses about {big} kilowatts when every node is busy.",
           "Cables are labeled at both ends so that nobody has to guess.",
           "Fast storage matters as much as fast processors.",
           "The machines in the last row are the oldest and the loudest.",
           "Nodes are drained before an upgrade, so that no job is cut off."],
    lines=["Node {n} is down again.", "Did the checkpoint finish?", "Who started this job?",
           "The queue is longer than yesterday.", "I will restart the scheduler.",
           "The fans are very loud tonight.", "Check the logs before you reboot anything.",
           "We need {n} more disks.", "Is the network slow for you too?",
           "The job crashed after {n} hours.", "Let us drain the rack first."],
)

topic(
    "experts",
    titles=["How the router learns", "A layer of experts", "Balancing the load",
            "Notes on routing", "Why expert {n} was idle"],
    people="researcher engineer student reviewer maintainer teacher".split(),
    things="token expert router gate batch layer gradient weight score sequence step "
           "loss_curve matrix/matrices vector group head block".split(),
    stuff="data memory load noise compute training".split(),
    adjs="busy idle small large sparse dense stable noisy balanced uneven shared popular "
         "rare careful".split(),
    acts=["<route/routed> each token to {few} experts", "<measure/measured> the load on every expert",
          "<plot/plotted> the loss curve", "<add/added> a small balancing loss",
          "<lower/lowered> the learning rate", "<double/doubled> the number of experts",
          "<count/counted> the tokens that reached each expert", "<sort/sorted> the tokens by expert",
          "<train/trained> the model for {big} steps", "<compare/compared> the dense model and the sparse one",
          "<freeze/froze> the router for a few steps", "<inspect/inspected> the scores of the gate",
          "<group/grouped> the experts into {few} groups", "<share/shared> one expert across all tokens",
          "<scale/scaled> the weights of the chosen experts", "<check/checked> the gradients for overflow",
          "<save/saved> the router statistics"],
    events=["the loss|<fall/fell> steadily", "one expert|<receive/received> most of the tokens",
            "the router|<learn/learned> to spread the load", "the gradients+|<grow/grew> too large",
            "the training|<slow/slowed> down after {big} steps", "a few experts+|<stay/stayed> idle",
            "the balance|<improve/improved> after the change", "the loss curve|<flatten/flattened> out",
            "the scores+|<become/became> sharper", "the memory|<run/ran> out on the last layer",
            "the tokens+|<spread/spread> evenly across the experts"],
    places=["in every layer", "in the first block", "on each device", "in the router",
            "across the batch", "inside the expert layer", "in the last layer"],
    units=["{n} experts", "{big} tokens", "{big} steps", "{pct} percent of the tokens"],
    facts=["The router gives every token a score for each expert and keeps the best {few}.",
           "Each expert is a small feed-forward network with its own weights.",
           "A sparse model can hold many parameters and still use few of them per token.",
           "Without a balancing loss, the router tends to favor a handful of experts.",
           "Tokens that choose the same expert are gathered into one group before the matrix/matrices product.",
           "The output of a layer is the weighted sum of the experts that a token visited.",
           "A shared expert sees every token, while the routed experts see only some.",
           "In this run, {pct} percent of the tokens went to the busiest expert.",
           "Dropping tokens saves memory, but it also throws away part of the signal.",
           "The balancing loss is small, about one hundredth of the main loss.",
           "Each layer in the model has {n} experts, and each token visits {few} of them."],
    lines=["Which expert gets the most tokens?", "The loss is still going down.",
           "Did you add the balancing loss?", "Expert {n} has not seen a token in hours.",
           "Let us try {few} experts per token.", "The router looks stable now.",
           "Plot the load for every layer.", "Why is the first layer so uneven?",
           "The gradients look fine to me.", "We should run it for {big} more steps."],
)

topic(
    "garden",
    titles=["The garden in {month}", "Planting beans", "A year of tomatoes", "The old apple tree",
            "What grew by the wall"],
    people="gardener neighbor beekeeper farmer child/children volunteer".split(),
    things="seed bed tree rose bean tomato/tomatoes leaf/leaves root hedge path bench shovel rake "
           "wheelbarrow watering_can greenhouse pumpkin fence flower bee worm snail".split(),
    stuff="soil compost water grass mulch sunlight moss clay gravel".split(),
    adjs="green tall wild dry muddy young ripe heavy tidy overgrown shady sunny fragrant "
         "tender sturdy".split(),
    acts=["<plant/planted> a row of beans", "<water/watered> the tomatoes in the evening",
          "<dig/dug> a new bed near the fence", "<prune/pruned> the old apple tree",
          "<spread/spread> compost over the beds", "<pull/pulled> the weeds by hand",
          "<pick/picked> the first ripe tomatoes", "<sow/sowed> {few} rows of carrots",
          "<rake/raked> the leaves from the path", "<cut/cut> back the roses",
          "<fill/filled> the watering can at the well", "<tie/tied> the beans to tall sticks",
          "<cover/covered> the seedlings with straw", "<mow/mowed> the grass along the hedge",
          "<build/built> a small fence from old boards", "<move/moved> the bench into the shade",
          "<collect/collected> seeds for next year"],
    events=["the beans+|<climb/climbed> up the fence", "the roses+|<bloom/bloomed> in {month}",
            "the soil|<dry/dried> out in the heat", "the first leaves+|<appear/appeared> after a week",
            "the apples+|<fall/fell> in the night", "the snails+|<eat/ate> the young lettuce",
            "the bees+|<return/returned> to the hive", "the hedge|<grow/grew> wild over the summer",
            "the pumpkins+|<swell/swelled> in the sun", "the frost|<kill/killed> the last flowers",
            "the seeds+|<sprout/sprouted> in the greenhouse"],
    places=["in the garden", "by the wall", "near the greenhouse", "under the apple tree",
            "along the path", "behind the shed", "in the back corner", "at the edge of the lawn"],
    units=["{n} centimeters", "{few} rows", "{n} kilograms", "{n} days"],
    facts=["Beans grow best in warm soil and full sun.",
           "Tomatoes need water every day when the weather is hot.",
           "Compost turns kitchen scraps into rich, dark soil in about a year.",
           "Seeds should be planted about {n} millimeters deep.",
           "Bees visit the flowers most often in the late morning.",
           "An old apple tree can give {few} hundred apples in a good year.",
           "Mulch keeps the soil damp and the weeds down.",
           "Roses like a sunny place and a little shelter from the wind.",
           "Most vegetables need at least {few} hours of sunlight a day.",
           "Worms are a sign of healthy soil."],
    lines=["The beans are finally up.", "Did you water the tomatoes?", "Something ate the lettuce again.",
           "Pass me the rake, please.", "These roses smell wonderful.",
           "We should plant more carrots next year.", "The soil is too dry to dig.",
           "How tall is the sunflower now?", "Leave the snails for the birds.",
           "I found {n} ripe tomatoes this morning."],
)

topic(
    "harbor",
    titles=["Morning at the harbor", "The fishing boats", "A storm at sea", "The ferry to the island",
            "The lighthouse keeper"],
    people="fisher sailor captain harbor_master deckhand ferry_pilot net_mender".split(),
    things="boat net rope anchor sail mast pier ferry buoy crate gull wave dock hull oar "
           "lantern lighthouse/lighthouses island harbor_wall".split(),
    stuff="salt tar seaweed fish fuel spray water".split(),
    adjs="wet salty rough calm crowded old sturdy small bright weathered slippery noisy "
         "empty".split(),
    acts=["<mend/mended> the torn nets", "<tie/tied> the boat to the pier", "<raise/raised> the sail",
          "<drop/dropped> the anchor near the island", "<unload/unloaded> {n} crates of fish",
          "<paint/painted> the hull blue", "<coil/coiled> the ropes on the deck",
          "<steer/steered> the ferry past the rocks", "<check/checked> the fuel before leaving",
          "<row/rowed> out to the buoy", "<count/counted> the boats in the harbor",
          "<light/lit> the lantern at dusk", "<clean/cleaned> the deck with sea water",
          "<sell/sold> the catch at the market"],
    events=["the tide|<come/came> in quickly", "the boats+|<return/returned> before dawn",
            "the waves+|<break/broke> over the harbor wall", "the gulls+|<circle/circled> above the pier",
            "the ferry|<leave/left> at {clock}", "the wind|<fill/filled> the sails",
            "the lighthouse|<flash/flashed> every {n} seconds", "the fog|<roll/rolled> in from the sea",
            "the rope|<snap/snapped> in the storm", "the water|<turn/turned> gray and rough"],
    places=["at the harbor", "on the pier", "out at sea", "near the island", "by the lighthouse",
            "along the harbor wall", "on the deck", "in the fish market"],
    units=["{n} crates", "{n} meters", "{n} knots", "{few} hours"],
    facts=["The tide rises and falls twice a day.",
           "Fishing boats leave before dawn and return by noon.",
           "The ferry to the island takes about {n} minutes in calm weather.",
           "A good net can last for years if it is mended often.",
           "The lighthouse has warned ships away from the rocks for over a hundred years.",
           "Gulls follow the boats because the crews throw away small fish.",
           "Ropes are coiled so that they run free when they are needed.",
           "The harbor wall is {n} meters high and made of gray stone."],
    lines=["The sea is too rough today.", "Tie that rope tighter.", "When does the ferry leave?",
           "We caught {n} crates this morning.", "Watch out for the gulls.",
           "The tide is coming in.", "Is the lighthouse working again?",
           "I have never seen the harbor this quiet.", "Bring the nets inside before the rain."],
)

topic(
    "market",
    titles=["Market day", "The stall by the fountain", "Prices in {month}", "A basket of plums",
            "Saturday morning in the square"],
    people="vendor shopper baker cheesemaker butcher fruit_seller customer stallholder".split(),
    things="stall basket plum cheese coin scale apple/apples sack crate pear/pears umbrella "
           "awning price_tag bag melon jar loaf/loaves flower/flowers".split(),
    stuff="honey bread fruit money cheese coffee".split(),
    adjs="ripe fresh cheap expensive crowded busy sweet local soft loud colorful sour".split(),
    acts=["<buy/bought> a basket of plums", "<weigh/weighed> the apples on an old scale",
          "<count/counted> the coins twice", "<set/set> up the stall before dawn",
          "<sell/sold> {n} jars of honey", "<lower/lowered> the price of the pears",
          "<pack/packed> the cheese in paper", "<carry/carried> the crates from the van",
          "<taste/tasted> a slice of melon", "<wrap/wrapped> the flowers for a customer",
          "<write/wrote> new price tags", "<give/gave> a child a free apple",
          "<close/closed> the stall at noon"],
    events=["the square|<fill/filled> with shoppers", "the price of plums|<rise/rose> after the frost",
            "the vendors+|<call/called> out their prices", "the rain|<drive/drove> everyone under the awnings",
            "the bread|<sell/sold> out by ten", "the crowd|<thin/thinned> out after noon",
            "the fountain|<sparkle/sparkled> in the sun", "the last melons+|<go/went> cheap"],
    places=["in the square", "by the fountain", "at the corner stall", "under the awning",
            "near the church", "at the end of the row", "behind the cheese stall"],
    units=["{n} coins", "{n} kilograms", "{few} baskets", "{n} jars"],
    facts=["The market opens at {clock} and closes at noon.",
           "Plums are cheapest at the end of summer.",
           "Most stalls sell food that was grown within a day's drive.",
           "A kilogram of cheese costs about {n} coins.",
           "The best bread is gone an hour after the market opens.",
           "Vendors lower their prices just before they pack up.",
           "The market has been held in the same square every {day} for many years."],
    lines=["How much are the plums?", "Two kilograms, please.", "Do you have any honey left?",
           "These pears are not ripe yet.", "Keep the change.", "Can I taste the cheese?",
           "That is too expensive.", "Come back next {day}.", "We are out of bread."],
)

topic(
    "hiking",
    titles=["Up the ridge", "Three days in the hills", "The path to the lake", "Lost in the fog",
            "A map and a compass"],
    people="hiker guide climber ranger walker mountaineer".split(),
    things="trail ridge summit map compass boot backpack tent lake stream bridge cairn "
           "valley rock pine hut flask rope sign".split(),
    stuff="water snow mud gravel moss bread tea".split(),
    adjs="steep narrow rocky high cold quiet long muddy clear distant tired windy gentle "
         "lonely".split(),
    acts=["<climb/climbed> the steep path to the ridge", "<read/read> the map by torchlight",
          "<fill/filled> the flask at a stream", "<pitch/pitched> the tent near the lake",
          "<follow/followed> the cairns through the fog", "<cross/crossed> the old wooden bridge",
          "<rest/rested> on a flat rock", "<check/checked> the compass at every fork",
          "<pack/packed> the backpack the night before", "<walk/walked> {n} kilometers before lunch",
          "<dry/dried> the boots by the fire", "<share/shared> bread and cheese at the summit",
          "<take/took> the long way around the lake", "<turn/turned> back before the storm"],
    events=["the path|<grow/grew> steeper after the hut", "the fog|<hide/hid> the summit",
            "the stream|<run/ran> fast with melted snow", "the wind|<howl/howled> on the ridge",
            "the lake|<appear/appeared> below the trees", "the sun|<set/set> behind the peaks",
            "the trail|<vanish/vanished> under the snow", "the clouds+|<part/parted> for a moment"],
    places=["on the ridge", "by the lake", "near the summit", "in the pine forest",
            "at the mountain hut", "below the pass", "along the stream", "above the tree line"],
    units=["{n} kilometers", "{big} meters", "{few} hours", "{n} degrees"],
    facts=["The summit is {n}00 meters above the sea.",
           "The weather in the mountains can change within an hour.",
           "Cairns mark the path where the ground is bare rock.",
           "Water from the high streams is cold even in summer.",
           "The walk around the lake takes about {few} hours.",
           "A map and a compass are still more reliable than a phone.",
           "The mountain hut has {n} beds and a stove that burns wood."],
    lines=["How far is the hut?", "Let us rest here for a while.", "Which way is north?",
           "My boots are soaked.", "We should turn back before dark.", "Look at the view from here.",
           "Is there water in the stream?", "The map says {n} more kilometers."],
)

topic(
    "workshop",
    titles=["Fixing an old bicycle", "The workshop on {day}", "A new wheel", "Tools on the wall",
            "The chair that wobbled"],
    people="mechanic carpenter apprentice customer repairer welder".split(),
    things="bicycle wheel chain brake tire saddle spoke bolt wrench hammer saw drill plank "
           "chair table screw nail bench clamp ladder".split(),
    stuff="oil grease glue paint sawdust wood varnish rust".split(),
    adjs="loose rusty bent new old sharp smooth rough sturdy broken shiny heavy squeaky "
         "crooked".split(),
    acts=["<oil/oiled> the chain", "<tighten/tightened> the loose bolts", "<replace/replaced> a bent spoke",
          "<patch/patched> the inner tube", "<sand/sanded> the table until it was smooth",
          "<cut/cut> a plank to length", "<glue/glued> the leg of the chair",
          "<drill/drilled> {few} small holes", "<adjust/adjusted> the brakes",
          "<sweep/swept> the sawdust from the floor", "<hang/hung> the tools back on the wall",
          "<paint/painted> the frame dark green", "<measure/measured> the board twice before cutting",
          "<true/trued> the front wheel", "<clamp/clamped> the boards together overnight"],
    events=["the chain|<slip/slipped> off again", "the glue|<dry/dried> overnight",
            "the old saddle|<crack/cracked> in the cold", "the brakes+|<squeak/squeaked> on the hill",
            "the varnish|<take/took> two days to harden", "the drill|<stop/stopped> working",
            "the wheel|<spin/spun> true at last", "the chair|<wobble/wobbled> less than before"],
    places=["in the workshop", "on the workbench", "by the window", "under the stairs",
            "in the back room", "on the wall of tools"],
    units=["{n} millimeters", "{n} minutes", "{few} screws", "{n} centimeters"],
    facts=["A clean chain lasts much longer than a dirty one.",
           "Measure twice and cut once.",
           "Most squeaks come from a part that needs a drop of oil.",
           "Glue holds best when the joint is clamped until it is dry.",
           "A wheel has {n} spokes, and each one carries part of the load.",
           "Hardwood is heavier than pine and harder to cut.",
           "The tires should be pumped to about {n} times the pressure of the air."],
    lines=["Hand me the wrench.", "The chain needs oil.", "Where did you put the clamps?",
           "This bolt will not move.", "Is the glue dry yet?", "Careful, the saw is sharp.",
           "The brakes still squeak.", "Can you fix it by {day}?"],
)

topic(
    "library",
    titles=["The reading room", "A book that went missing", "Closing time", "The card catalog",
            "Letters from the archive"],
    people="librarian reader student archivist writer clerk visitor".split(),
    things="book shelf/shelves page map letter lamp desk catalog card chapter notebook ladder "
           "newspaper atlas/atlases dictionary/dictionaries pencil window".split(),
    stuff="paper dust ink silence light".split(),
    adjs="old thick rare quiet dusty heavy worn thin new forgotten careful famous torn".split(),
    acts=["<return/returned> the book a week late", "<sort/sorted> the new books by author",
          "<copy/copied> a page from the old atlas", "<read/read> until closing time",
          "<search/searched> the catalog for an hour", "<repair/repaired> a torn page",
          "<find/found> a letter inside the book", "<write/wrote> notes in pencil",
          "<climb/climbed> the ladder to the top shelf", "<stamp/stamped> the date on the card",
          "<dust/dusted> the shelves in the back room", "<borrow/borrowed> {few} books",
          "<turn/turned> off the lamps one by one"],
    events=["the reading room|<fall/fell> silent", "the old map|<crack/cracked> along the fold",
            "the lamps+|<flicker/flickered> during the storm", "a book|<go/went> missing",
            "the archive|<open/opened> on {day}", "the new shelves+|<arrive/arrived> in {month}",
            "the clock|<chime/chimed> at closing time"],
    places=["in the reading room", "on the top shelf", "in the archive", "at the front desk",
            "in the back room", "by the tall windows", "under the reading lamp"],
    units=["{big} books", "{n} pages", "{n} days", "{few} shelves"],
    facts=["The library holds about {big} books and a large collection of maps.",
           "Books may be borrowed for {n} days.",
           "Old paper lasts longer in cool, dry rooms.",
           "The reading room is open until {clock} on weekdays.",
           "Every book has a card in the catalog with its author and its place on the shelves.",
           "Rare books are kept in the archive and read only at the front desk."],
    lines=["Please keep your voice down.", "Where are the atlases?", "This book is overdue.",
           "Can I borrow this one?", "We close in {n} minutes.", "The archive is on the second floor.",
           "Someone tore a page out of this.", "Have you read this one?"],
)

topic(
    "music",
    titles=["The rehearsal", "A concert in {month}", "Tuning the old piano", "The brass band",
            "Practice every day"],
    people="violinist pianist conductor singer drummer cellist student teacher".split(),
    things="piano violin drum song chord note string bow score stage concert choir trumpet "
           "melody rehearsal metronome bench".split(),
    stuff="music rhythm applause silence noise".split(),
    adjs="loud soft slow fast sharp flat sweet old bright gentle steady nervous joyful "
         "difficult".split(),
    acts=["<tune/tuned> the violin before the concert", "<practice/practiced> the scales for an hour",
          "<play/played> the melody once more", "<count/counted> the beats aloud",
          "<replace/replaced> a broken string", "<sing/sang> the second verse alone",
          "<mark/marked> the difficult bars in pencil", "<set/set> the metronome a little slower",
          "<lead/led> the choir through the last song", "<learn/learned> a new piece by heart",
          "<tap/tapped> the rhythm on the table", "<close/closed> the piano lid"],
    events=["the audience|<fall/fell> silent", "the drums+|<start/started> too early",
            "the last chord|<ring/rang> through the hall", "a string|<break/broke> in the second act",
            "the choir|<find/found> the right key", "the applause|<last/lasted> for minutes",
            "the tempo|<slow/slowed> near the end", "the old piano|<sound/sounded> out of tune"],
    places=["on the stage", "in the concert hall", "in the practice room", "at the back of the choir",
            "by the piano", "in the front row"],
    units=["{n} bars", "{few} songs", "{n} minutes", "{few} verses"],
    facts=["A violin has four strings and is played with a bow.",
           "The choir practices every {day} evening.",
           "A piano should be tuned at least once a year.",
           "The concert lasts about ninety minutes with one short break.",
           "Slow practice is the fastest way to learn a difficult passage.",
           "The orchestra tunes to a single note from the oboe."],
    lines=["Once more from the top.", "You are rushing the tempo.", "Can you hear the cellos?",
           "That note was flat.", "Let us take a short break.", "The concert starts at {clock}.",
           "Count the rests, please.", "I forgot my music at home."],
)

topic(
    "sky",
    titles=["A night of stars", "The telescope on the roof", "Watching the moon", "Clear skies in {month}",
            "Counting meteors"],
    people="astronomer observer student stargazer teacher navigator".split(),
    things="star planet moon telescope comet meteor lens constellation orbit crater "
           "eyepiece chart cloud horizon shadow".split(),
    stuff="light darkness dust starlight".split(),
    adjs="bright faint distant clear dark full pale red steady cold vast silent".split(),
    acts=["<point/pointed> the telescope at the moon", "<count/counted> {n} meteors in an hour",
          "<draw/drew> a chart of the stars", "<clean/cleaned> the lens",
          "<wait/waited> for the clouds to pass", "<find/found> the north star",
          "<write/wrote> down the time of each meteor", "<follow/followed> the planet across the sky",
          "<focus/focused> the eyepiece", "<set/set> up the telescope on the roof"],
    events=["the moon|<rise/rose> over the hills", "a bright meteor|<cross/crossed> the sky",
            "the clouds+|<cover/covered> the stars", "the planet|<shine/shone> low in the {dir}",
            "the stars+|<fade/faded> before dawn", "the comet|<grow/grew> brighter each night",
            "the shadow|<creep/crept> across the moon"],
    places=["on the roof", "in the field behind the house", "above the horizon", "near the moon",
            "in the {dir}", "far from the city lights"],
    units=["{n} meteors", "{big} light years", "{n} degrees", "{few} hours"],
    facts=["The moon takes about {n} days to go through its phases.",
           "Stars twinkle because the air above us is never still.",
           "The planets move against the fixed pattern of the stars.",
           "Meteors are grains of dust that burn up high in the air.",
           "The sky is darkest far from the lights of the city.",
           "A small telescope can show the craters of the moon."],
    lines=["Look, a shooting star!", "Is that a planet or a star?", "The moon is too bright tonight.",
           "Can you see the comet?", "My hands are cold.", "Focus the lens a little more.",
           "Wait for the clouds to pass."],
)

TOPIC_NAMES = tuple(TOPICS)
PARAGRAPH_KEYS = ("act", "event", "fact", "line", "answer")

# ---------------------------------------------------------------------------------------------
# Grammar


def _words(xs: list[str]) -> list[str]:
    return [x.replace("_", " ") for x in xs]


class Writer:
    """Expands sentence patterns for one topic with one random stream."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.t: dict = {}
        self.used: dict[str, set] = {}  # per sentence
        self.para: dict[str, set] = {}  # per paragraph

    def use(self, name: str) -> None:
        self.t = TOPICS[name]

    # -- picks ---------------------------------------------------------------------------------
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

    def number(self) -> str:
        return str(self.rng.randint(2, 40))

    def slot(self, name: str) -> str:
        r, t = self.rng, self.t
        if name == "thing":
            return singular(self.pick(_words(t["things"]), "thing"))
        if name == "things":
            return plural(self.pick(_words(t["things"]), "thing"))
        if name == "a_thing":
            return article(singular(self.pick(_words(t["things"]), "thing")))
        if name == "stuff":
            return self.pick(_words(t["stuff"]), "stuff")
        if name == "adj":
            return self.pick(t["adjs"], "adj")
        if name == "person":
            return "the " + self.pick(_words(t["people"]), "person")
        if name == "place":
            return self.fill(self.pick(t["places"], "place"))
        if name == "unit":
            return self.fill(self.pick(t["units"]))
        if name == "name":
            return self.pick(NAMES, "name")
        if name == "n":
            return self.number()
        if name == "few":
            return r.choice(NUMBER_WORDS[:8])
        if name == "big":
            return f"{r.choice(BIG_NUMBERS):,}"
        if name == "pct":
            return str(r.randrange(5, 100, 5))
        if name == "clock":
            return f"{r.randint(1, 12)}:{r.choice(MINUTES)}"
        if name == "day":
            return r.choice(DAYS)
        if name == "month":
            return self.pick(MONTHS, "month")
        if name == "dir":
            return r.choice(DIRECTIONS)
        raise KeyError(name)

    def fill(self, template: str) -> str:
        return re.sub(r"\{(\w+)\}", lambda m: self.slot(m.group(1)), template)

    # -- phrases -------------------------------------------------------------------------------
    def subject(self, allow_pronoun: bool = True) -> tuple[str, str]:
        """A subject and its person: '1s' (I), '3s', or 'pl'."""
        r = self.rng.random()
        if r < 0.32:
            return self.pick(NAMES, "name"), "3s"
        if r < 0.6:
            return "the " + self.pick(_words(self.t["people"]), "person"), "3s"
        if r < 0.7:
            return f"{self.rng.choice(['my', 'our'])} {self.pick(FAMILY, 'family')}", "3s"
        if r < 0.8:
            return "the " + plural(self.pick(_words(self.t["people"]), "person")), "pl"
        if r < 0.86:
            a, b = self.pick(NAMES, "name"), self.pick(NAMES, "name")
            return f"{a} and {b}", "pl"
        if not allow_pronoun:
            return self.pick(NAMES, "name"), "3s"
        return self.rng.choice([("she", "3s"), ("he", "3s"), ("they", "pl"), ("we", "pl"),
                                ("I", "1s")])

    @staticmethod
    def form(person: str, tense: str) -> str:
        return "past" if tense == "past" else ("s" if person == "3s" else "base")

    @staticmethod
    def be(person: str, tense: str) -> str:
        if tense == "past":
            return "were" if person == "pl" else "was"
        return {"1s": "am", "3s": "is", "pl": "are"}[person]

    def vp(self, person: str, tense: str) -> str:
        return conjugate(self.fill(self.pick(self.t["acts"], "act")), self.form(person, tense))

    def vp_base(self) -> str:
        return conjugate(self.fill(self.pick(self.t["acts"], "act")), "base")

    def event(self, tense: str) -> str:
        subj, _, rest = self.pick(self.t["events"], "event").partition("|")
        person = "pl" if subj.endswith("+") else "3s"
        subj = self.fill(subj.rstrip("+"))
        return f"{subj} {conjugate(self.fill(rest), self.form(person, tense))}"

    def clause(self, tense: str) -> str:
        if self.rng.random() < 0.45:
            return self.event(tense)
        subj, person = self.subject()
        return f"{subj} {self.vp(person, tense)}"

    def time(self, tense: str) -> str:
        return self.fill(self.rng.choice(PAST_TIMES if tense == "past" else PRESENT_TIMES))

    # -- sentences -----------------------------------------------------------------------------
    def sentence(self, tense: str) -> str:
        self.used = {}
        r = self.rng
        kind = r.choices(
            ["action", "event", "describe", "there", "complex", "report", "modal", "fact",
             "list", "feeling", "compare", "measure"],
            weights=[16, 10, 9, 7, 16, 8, 9, 10, 3, 5, 3, 4])[0]
        s = getattr(self, "s_" + kind)(tense)
        return capitalize(s)

    def s_action(self, tense: str) -> str:
        subj, person = self.subject()
        s = f"{subj} {self.vp(person, tense)}"
        r = self.rng.random()
        if r < 0.35:
            s = f"{self.time(tense)}, {s}"
        elif r < 0.55:
            s = f"{s} {self.slot('place')}"
        elif r < 0.65:
            s = f"{s} {self.rng.choice(ADVERBS)}"
        return s + "."

    def s_event(self, tense: str) -> str:
        s = self.event(tense)
        r = self.rng.random()
        if r < 0.4:
            s = f"{self.time(tense)}, {s}"
        elif r < 0.6:
            s = f"{s}, and {self.event(tense)}"
        return s + "."

    def s_describe(self, tense: str) -> str:
        r = self.rng.random()
        be1, bepl = self.be("3s", tense), self.be("pl", tense)
        if r < 0.3:
            return self.fill(f"the {{thing}} {be1} {{adj}}, and the {{thing}} {be1} {{adj}}.")
        if r < 0.55:
            return self.fill(f"the {{things}} {{place}} {bepl} {{adj}} and {{adj}}.")
        if r < 0.7:
            return self.fill(f"everything {{place}} {be1} {{adj}}.")
        if r < 0.85:
            degree = self.rng.choice(["very", "rather", "too", "quite", "a little"])
            return self.fill(f"the {{stuff}} {be1} {degree} {{adj}}.")
        when = self.rng.choice(["day", "morning", "evening", "week", "night"])
        return self.fill(f"it {be1} {article(self.rng.choice(DAY_ADJS))} {when} {{place}}.")

    def s_there(self, tense: str) -> str:
        r = self.rng.random()
        be1, bepl = self.be("3s", tense), self.be("pl", tense)
        if r < 0.4:
            return self.fill(f"there {bepl} {{few}} {{adj}} {{things}} {{place}}.")
        if r < 0.7:
            return self.fill(f"there {be1} {{a_thing}} {{place}}, and it {be1} {{adj}}.")
        if r < 0.85:
            return self.fill(f"there {be1} not much {{stuff}} left.")
        return self.fill(f"there {be1} no {{stuff}} {{place}} at all.")

    def s_complex(self, tense: str) -> str:
        r = self.rng.random()
        a, b = self.clause(tense), self.clause(tense)
        if r < 0.2:
            return f"when {a}, {b}."
        if r < 0.35:
            return f"{a}, {self.rng.choice(CONTRASTS)} {b}."
        if r < 0.5:
            return f"because {a}, {b}."
        if r < 0.62:
            return f"{a}, so {b}."
        if r < 0.74:
            return f"{a} while {b}."
        if r < 0.84:
            return f"{a}; {b}."
        if r < 0.92:
            return f"before {a}, {b}."
        return f"{a}, and then {b}."

    def s_report(self, tense: str) -> str:
        subj, person = self.subject(allow_pronoun=self.rng.random() < 0.5)
        verb = conjugate(self.rng.choice(REPORT), self.form(person, tense))
        inner = self.clause(tense)
        if self.rng.random() < 0.3:
            but = self.rng.choice(CONTRASTS)
            return f"{subj} {verb} that {inner}, {but} {self.clause(tense)}."
        return f"{subj} {verb} that {inner}."

    def s_modal(self, tense: str) -> str:
        subj, person = self.subject()
        r = self.rng.random()
        if r < 0.55:
            cat = conjugate(self.rng.choice(CATENATIVES), self.form(person, tense))
            return f"{subj} {cat} {self.vp_base()}."
        if tense == "past":
            modal = self.rng.choice(["could not", "would", "had to", "did not", "could"])
            when = f" {self.time(tense).lower()}" if self.rng.random() < 0.3 else ""
        else:
            negative = "does not" if person == "3s" else "do not"
            modal = self.rng.choice(["can", "will", "should", "must", negative, "might", "cannot"])
            when = ""
        return f"{subj} {modal} {self.vp_base()}{when}."

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
        feel = self.rng.choice(FEELINGS)
        if self.rng.random() < 0.5:
            return f"{subj} {self.be(person, tense)} {feel} that {self.event(tense)}."
        verb = conjugate("<feel/felt>", self.form(person, tense))
        return f"{subj} {verb} {feel} when {self.event(tense)}."

    def s_compare(self, tense: str) -> str:
        be1 = self.be("3s", tense)
        if self.rng.random() < 0.5:
            return self.fill(f"the {{thing}} {be1} not as {{adj}} as the {{thing}}.")
        return self.fill(f"the {{thing}} {be1} {{adj}}, just as {{name}} expected.")

    def s_measure(self, tense: str) -> str:
        r = self.rng.random()
        if r < 0.35:
            took = conjugate("<take/took>", "past" if tense == "past" else "s")
            return f"it {took} about {self.fill(self.rng.choice(DURATIONS))} in all."
        if r < 0.7:
            subj, person = self.subject(allow_pronoun=False)
            counted = conjugate("<count/counted>", self.form(person, tense))
            return f"{subj} {counted} {self.slot('unit')}."
        return self.fill(f"by the end, there {self.be('pl', tense)} {{unit}} {{place}}.")

    # -- paragraphs ----------------------------------------------------------------------------
    def paragraph(self) -> str:
        r = self.rng.random()
        if r < 0.12:
            return self.instructions()
        tense = "past" if r < 0.62 else "present"
        n = self.rng.randint(3, 7)
        sents = []
        self.used, self.para = {}, {}
        sents.append(capitalize(f"{self.time(tense)}, {self.clause(tense)}."))
        for _ in range(n - 1):
            sents.append(self.sentence(tense))
        return " ".join(sents)

    def instructions(self) -> str:
        self.used, self.para = {}, {}
        opener = self.rng.choice([
            "Here is how {person} does it.", "To get it right, follow these steps.",
            "The method is simple.", "{name} explained the routine to a newcomer.",
            "This is the usual order of work.", "Anyone can learn it in an afternoon."])
        words = ["First", "Then", "Next", "After that"]
        order = words[:self.rng.randint(2, 4)] + ["Finally"]
        sents = [self.fill(opener)]
        for w in order:
            r = self.rng.random()
            extra = ""
            if r < 0.25:
                extra = " " + self.rng.choice(ADVERBS)
            elif r < 0.4:
                extra = " " + self.slot("place")
            sents.append(f"{w}, {self.vp_base()}{extra}.")
        if self.rng.random() < 0.5:
            sents.append(capitalize(f"if {self.event('present')}, {self.vp_base()}."))
        return " ".join(sents)

    def utterance(self) -> str:
        r = self.rng.random()
        self.used = {}
        if r < 0.45:
            return self.fill(self.pick(self.t["lines"], "line"))
        if r < 0.55:
            return f"Did you {self.vp_base()}?"
        if r < 0.63:
            return f"Can you {self.vp_base()}?"
        if r < 0.7:
            return f"Is the {self.slot('thing')} {self.slot('adj')}?"
        if r < 0.78:
            return capitalize(f"I think {self.event('present')}.")
        if r < 0.86:
            return capitalize(f"we need to {self.vp_base()}.")
        if r < 0.92:
            return f"How many {self.slot('things')} do we have?"
        return capitalize(f"{self.event('past')}, did you see?")

    def dialogue(self) -> list[str]:
        a, b = self.rng.sample(NAMES, 2)
        self.para = {}
        lines, speaker, asked = [], a, False
        for _ in range(self.rng.randint(2, 5)):
            if asked and self.rng.random() < 0.6:
                u = self.fill(self.pick(ANSWERS, "answer"))
            else:
                u = self.utterance()
            asked = u.endswith("?")
            lines.append(self.quote(u, speaker))
            speaker = b if speaker == a else a
        return lines

    def quote(self, u: str, who: str) -> str:
        r = self.rng.random()
        question = u.endswith("?") or u.endswith("!")
        verb = "asked" if u.endswith("?") else self.rng.choice(SPEECH_VERBS)
        if r < 0.45:
            body = u if question else u[:-1] + ","
            return f"\"{body}\" {verb} {who}." if r < 0.3 else f"\"{body}\" {who} {verb}."
        if r < 0.7:
            return f"{who} {verb}, \"{u}\""
        if r < 0.85:
            extra = self.utterance()
            body = u if question else u[:-1] + ","
            return f"\"{body}\" {who} {verb}. \"{extra}\""
        return f"\"{u}\""


def generate(target_bytes: int = TARGET_BYTES, seed: int = SEED) -> str:
    """The corpus text: sections of titled paragraphs and dialogue, about ``target_bytes`` long."""
    rng = random.Random(seed)
    w = Writer(rng)
    blocks: list[str] = []
    size = 0
    section = 0
    while size < target_bytes:
        section += 1
        name = rng.choice(TOPIC_NAMES)
        w.use(name)
        w.used = {}
        title = w.fill(rng.choice(w.t["titles"]))
        part = [title]
        for _ in range(rng.randint(2, 6)):
            if rng.random() < 0.25:
                part.extend(w.dialogue())
            else:
                part.append(w.paragraph())
        block = "\n\n".join(part)
        blocks.append(block)
        size += len(block.encode()) + 3
    return "\n\n\n".join(blocks) + "\n"


def check(path: Path = DEFAULT_OUT) -> bool:
    """True when ``path`` holds exactly what :func:`generate` produces."""
    try:
        return path.read_bytes() == generate().encode("utf-8")
    except FileNotFoundError:
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moe_train.corpus",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT,
                    help=f"output file (default {DEFAULT_OUT})")
    ap.add_argument("--check", action="store_true",
                    help="do not write; exit 1 if the file differs from the generator's output")
    args = ap.parse_args(argv)
    if args.check:
        if check(args.out):
            print(f"{args.out}: up to date")
            return 0
        print(f"{args.out}: differs from the generator; run python -m moe_train.corpus",
              file=sys.stderr)
        return 1
    text = generate()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(text.encode("utf-8"))
    print(f"wrote {args.out} ({len(text.encode()):,} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
