"""The job secret: what a good one is (``contract.check_secret`` refuses a bad one where a process starts), and
the trainer keys derived from it. Standard library only: it runs on every node; imports nothing of the package
and names no variable (``contract`` says which variable carries a secret)."""

from __future__ import annotations

import functools
import hashlib
import hmac
import math
import secrets
from typing import List, Optional, Tuple

# The launcher makes 64 hex digits; anything under 32 characters is refused where a runtime process starts.
MIN_SECRET_CHARS = 32
# What ``estimate`` must give a secret at least: far below a generated one (32 random hex digits estimate 90 bits
# or more, 64 over 200), far above typed ones (a word or keyboard run repeated, with digits: 15 to 50).
MIN_SECRET_BITS = 64
# A secret is generated, never typed: hex digits, as ``generate`` (``paddle-cluster secret``), ``secrets.token_hex``
# and ``openssl rand -hex`` print them. A typed passphrase (words, a pangram, keyboard walks) has far less
# entropy than its length suggests, and no estimate knows every pattern a person types.
HEX_DIGITS = frozenset("0123456789abcdefABCDEF")


def generate() -> str:
    """A new job secret: 32 random bytes as 64 hex digits (what the launcher makes for every job)."""
    return secrets.token_hex(32)


def derive_trainer_key(secret: str, job_id: str, trainer: int) -> str:
    """Trainer ``trainer``'s own key (64 hex digits) from the job secret: a trainer gets this, never the
    secret, so it can prove its own id and no other (pservers derive every trainer's key)."""
    msg = b"paddle-cluster trainer key|" + job_id.encode("utf-8") + b"|" + str(int(trainer)).encode("ascii")
    return hmac.new(secret.encode("utf-8"), msg, hashlib.sha256).hexdigest()


def secret_problem(value: str) -> Optional[str]:
    """What is wrong with ``value`` as a secret, as the rest of a sentence about its variable ("is not set"):
    empty, short or easy to guess (under ``MIN_SECRET_BITS`` by ``estimate``); None when it is fine. Never shows
    the secret."""
    if not value or len(value) < MIN_SECRET_CHARS:
        return "is not set" if not value else f"has {len(value)} characters, fewer than {MIN_SECRET_CHARS}"
    if not HEX_DIGITS.issuperset(value):
        return ("is not a generated secret: it has characters other than hex digits (a typed passphrase is easy to "
                "guess whatever its length); make one with `paddle-cluster secret`")
    bits, kinds = estimate(value)
    if bits >= MIN_SECRET_BITS:
        return None
    made = f" of {', '.join(kinds)}" if kinds else ""
    return (f"is too easy to guess (about {bits:.0f} bits, made{made}; at least {MIN_SECRET_BITS} are needed, "
            "a generated one carries 128 or more)")


# -- the estimate ------------------------------------------------------------------------------------------
# zxcvbn's idea, small: a secret is the cheapest sequence of pieces an attacker would try -- a common word, a run
# along the keyboard or the alphabet, a year, a piece repeated, else characters one by one from their class --
# and its strength is log2 of the guesses that sequence takes. Random characters cost their class's size each;
# every pattern costs far less than the characters it covers.

# Common passwords and the words a job's secret is typed from, most common first (the rank is the guesses).
WORDS = tuple("""password 123456 qwerty secret admin letmein welcome monkey dragon master login abc123 iloveyou
sunshine princess football baseball shadow superman trustno1 hello freedom whatever michael jordan pass word love
god money computer internet python linux root user default changeme token key test guest paddle paddlepaddle
cluster train trainer server pserver job model deep learning tensor baidu tiger summer winter spring autumn
flower orange banana apple cherry purple silver golden black white green yellow blue red star moon sun sky
admin1 access batman charlie daniel thomas hunter ranger buster soccer hockey killer george andrew michelle
jessica pepper ginger maggie secure private hidden magic mustang cookie coffee chocolate player matrix
forever family friend happy lucky angel heaven hell home house music party dead beef cafe babe face feed fade
bead deaf decade facade accede added abba acdc""".split())
_RANK = {w: i + 1 for i, w in enumerate(dict.fromkeys(WORDS))}
_LONGEST = max(map(len, _RANK))
_LEET = str.maketrans("4@8(3610$5+7!|2", "aabceiloosttilz")
KEYBOARD = ("`1234567890-=", "qwertyuiop[]\\", "asdfghjkl;'", "zxcvbnm,./", "~!@#$%^&*()_+", "qwertyuiop{}|",
            'asdfghjkl:"', "zxcvbnm<>?", "1qaz2wsx3edc4rfv5tgb6yhn7ujm8ik,9ol.0p;/-['=]")
_KEY_STARTS = sum(len(r) for r in KEYBOARD)


def _class_size(c: str) -> int:
    return 10 if c.isdigit() else 26 if c.isalpha() and c.isascii() else 33 if c.isascii() else 100


def _word(piece: str) -> float:
    """Guesses for ``piece`` as a listed word, l33t or capitalised maybe; 0 when it is none."""
    low = piece.lower()
    rank = _RANK.get(low) or _RANK.get(low.translate(_LEET))
    if not rank:
        return 0.0
    subs = sum(a != b for a, b in zip(low, low.translate(_LEET))) if low not in _RANK else 0
    upper = sum(c.isupper() for c in piece)
    case = 1 if not upper else 2 if upper == len(piece) or (upper == 1 and piece[0].isupper()) else 2 ** upper
    return rank * case * 2 ** subs


def _run(piece: str) -> float:
    """Guesses for ``piece`` as a run: a constant step through the character codes (``abcd``, ``9753``) or along
    a keyboard row or column (``qwerty``, ``1qaz``), either way; 0 when it is none."""
    steps = {ord(b) - ord(a) for a, b in zip(piece, piece[1:])}
    if len(steps) == 1 and abs(next(iter(steps))) <= 5:
        return 36 * 2 * 5 * len(piece)  # its start, direction and step, and its length
    low = piece.lower()
    if any(low in row or low[::-1] in row for row in KEYBOARD):
        return _KEY_STARTS * 2 * len(piece)
    return 0.0


def estimate(value: str) -> Tuple[float, Tuple[str, ...]]:
    """log2 of the guesses ``value`` takes as its cheapest sequence of pieces, and the kinds of pattern in it
    ("a common word", ...; none for random characters). Quadratic in the length only where a piece repeats."""
    return _estimate(value, True)


def _offer(best: List[Tuple[float, Tuple[str, ...]]], i: int, j: int, bits: float, *kinds: str) -> None:
    """The piece ``i:j`` at ``bits`` (made of ``kinds`` of pattern): kept as the way to ``j`` when cheaper than the
    best so far."""
    here, before = best[i]
    if here + bits < best[j][0]:
        best[j] = (here + bits, before + tuple(k for k in dict.fromkeys(kinds) if k not in before))


def _estimate(s: str, repeats: bool) -> Tuple[float, Tuple[str, ...]]:
    n = len(s)
    best: List[Tuple[float, Tuple[str, ...]]] = [(0.0, ())] + [(math.inf, ())] * n
    for i in range(n):
        if best[i][0] == math.inf:
            continue
        offer = functools.partial(_offer, best, i)
        offer(i + 1, math.log2(_class_size(s[i])))
        for j in range(i + 3, min(n, i + _LONGEST) + 1):
            if _word(s[i:j]):
                offer(j, math.log2(_word(s[i:j])) + 1, "a common word")
        if s[i:i + 4].isdigit() and 1900 <= int(s[i:i + 4]) <= 2099:
            offer(i + 4, math.log2(200) + 1, "a year")
        j = i + 3
        while j <= n and _run(s[i:j]):  # a run's every prefix is one
            offer(j, math.log2(_run(s[i:j])) + 1, "a keyboard or alphabet run")
            j += 1
        _numbers(s, i, offer)
        _interleaved(s, i, offer)
        for p in range(1, n - i - 2) if repeats else ():  # a piece, then all or 3+ characters of it again
            base, k, cost = s[i:i + p], 1, None
            while s[i + k * p:i + (k + 1) * p] == base:
                k += 1
                cost = cost or _estimate(base, False)
                offer(i + k * p, cost[0] + math.log2(k) + 1, *cost[1], "a repeated piece")
            at = i + k * p  # a last repeat cut short ("abcdabcdab"): three characters of it at least
            tail = _common(s, at, base) if p > 3 and s[at:at + 3] == base[:3] else 0
            if tail >= 3:
                cost = cost or _estimate(base, False)
                offer(i + k * p + tail, cost[0] + math.log2(k + 1) + math.log2(p) + 1, *cost[1], "a repeated piece")
    return best[n]


def _common(s: str, at: int, base: str) -> int:
    """How many characters of ``s`` from ``at`` on repeat ``base`` from its start (fewer than all of it)."""
    t = 0
    while t < len(base) - 1 and at + t < len(s) and s[at + t] == base[t]:
        t += 1
    return t


def _numbers(s: str, i: int, offer: functools.partial) -> None:
    """Offer the counting sequences from ``i``: numbers of 1 to 4 digits, each the one before plus a constant
    step (``1970197119721973``, ``0001000200030004``, ``102030``), at least three of them."""
    for w in (1, 2, 3, 4):
        if not s[i:i + w].isdigit():
            return
        step, count, j = None, 1, i + w
        while j + w <= len(s) and s[j:j + w].isdigit():
            d = int(s[j:j + w]) - int(s[j - w:j])
            if d == 0 or abs(d) > 100 or (step is not None and d != step):
                break
            step, count, j = d, count + 1, j + w
            if count >= 3:  # its first number, its step, how many
                offer(j, w * math.log2(10) + math.log2(200) + math.log2(count) + 1, "a sequence of numbers")


def _interleaved(s: str, i: int, offer: functools.partial) -> None:
    """Offer two runs taken in turn from ``i`` (``a1b2c3d4``, ``1q2w3e4r``): each half is a run (``_run``)."""
    j = i + 6
    while j <= len(s):
        a, b = _run(s[i:j:2]), _run(s[i + 1:j:2])
        if not (a and b):
            return
        offer(j, math.log2(a) + math.log2(b) + 1, "two runs interleaved")
        j += 2
