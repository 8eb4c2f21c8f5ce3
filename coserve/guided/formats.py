"""JSON Schema string ``format``s that structured outputs enforce (as OpenAI's strict mode does), each as a
pattern (``regex.py`` syntax) the whole decoded string matches. Every text a pattern takes is valid for its
format (dates are checked against the calendar, leap years included); some valid texts are left out (leap
seconds, fractions of more than 6 digits, quoted or IP-literal e-mail addresses). Other formats stay
annotations, as JSON Schema makes them by default."""

from __future__ import annotations

_YEAR = r"(?:000[1-9]|00[1-9]\d|0[1-9]\d\d|[1-9]\d{3})"
_LEAP_YEAR = r"(?:\d\d(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_MONTH_DAY = r"(?:(?:0[13578]|1[02])-(?:0[1-9]|[12]\d|3[01])|(?:0[469]|11)-(?:0[1-9]|[12]\d|30)|02-(?:0[1-9]|1\d|2[0-8]))"
DATE = rf"(?:{_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)"
TIME = r"(?:[01]\d|2[0-3]):[0-5]\d:[0-5]\d(?:\.\d{1,6})?(?:Z|[+-](?:[01]\d|2[0-3]):[0-5]\d)"
_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_ATOM = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+"

FORMATS = {
    "date": DATE,
    "time": TIME,
    "date-time": rf"{DATE}T{TIME}",
    "uuid": r"[0-9a-fA-F]{8}-(?:[0-9a-fA-F]{4}-){3}[0-9a-fA-F]{12}",
    "ipv4": rf"(?:{_OCTET}\.){{3}}{_OCTET}",
    "hostname": rf"{_LABEL}(?:\.{_LABEL}){{0,15}}",
    "email": rf"{_ATOM}(?:\.{_ATOM}){{0,7}}@{_LABEL}(?:\.{_LABEL}){{1,8}}",
}
