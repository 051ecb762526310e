"""Where Kubernetes' CEL (cel-go, with the Kubernetes libraries) and cel-cpp differ, and the limits
Kubernetes puts on selectors: what the validator must accept, skip or estimate itself so that it
never denies a selector the apiserver and the scheduler accept.

cel-cpp reports compile errors only as text ("ERROR: <input>:1:4: undeclared reference to 'find'"),
so the tables here are patterns over that text.
"""

from __future__ import annotations

import re

from dra_gpu.kube.values import MAX_ATTRIBUTES_AND_CAPACITIES

MAX_EXPRESSION_LENGTH = 10 * 1024  # CELSelectorExpressionMaxLength
MAX_ESTIMATED_COST = 1_000_000  # CELSelectorExpressionMaxCost
MAX_MAP_SIZE = MAX_ATTRIBUTES_AND_CAPACITIES  # the size cel-go assumes for a device's maps

_ERROR_LINE = re.compile(r"ERROR: <input>:(\d+):(\d+): ([^\n]*)")

# Functions of the Kubernetes CEL libraries in the DRA environment (k8s.io/apiserver/pkg/cel/environment,
# base.go, compatibility version 1.36) that cel-cpp does not provide: Regex, Lists, ext.Lists(3), ext.Sets,
# URLs, IP, CIDR, Format and two-variable comprehensions. An expression that fails to compile only for
# these is valid for the apiserver and the scheduler: it is not denied, only neither checked nor simulated.
UNMODELLED_FUNCTIONS = frozenset(
    {
        # library.Regex
        "find", "findAll",
        # library.Lists (v0), ext.Lists (v3)
        "isSorted", "sum", "min", "max", "indexOf", "lastIndexOf", "lists", "range", "flatten",
        "distinct", "slice", "sort", "sortBy",
        # ext.Sets
        "sets", "contains", "equivalent", "intersects",
        # library.URLs, library.IP, library.CIDR
        "url", "isURL", "getScheme", "getHost", "getHostname", "getPort", "getEscapedPath", "getQuery",
        "ip", "isIP", "cidr", "isCIDR", "family", "isUnspecified", "isLoopback", "isLinkLocalMulticast",
        "isLinkLocalUnicast", "isGlobalUnicast", "isCanonical", "prefixLength", "masked",
        # library.Format
        "format", "named", "validate", "dns1123Label", "dns1123Subdomain", "dns1035Label",
        "qualifiedName", "dns1123LabelPrefix", "dns1123SubdomainPrefix", "dns1035LabelPrefix",
        "labelValue", "uri", "uuid", "byte", "date", "datetime",
        # ext.TwoVarComprehensions
        "all", "exists", "existsOne", "transformList", "transformMap", "transformMapEntry",
    }
)  # fmt: skip
_UNDECLARED = re.compile(r"undeclared reference to '([^']+)'|found no matching overload for '([^']+)'")
# Typed-check errors that are not errors for Kubernetes: there attribute values are `dyn`, comparisons
# across int/uint/double are enabled (cel.CrossTypeNumericComparisons) and equality is heterogeneous,
# and each of these evaluates fine at runtime: `index > 2.5`, `index < 6u`, `index == 3.0`,
# `numaNode != null`, `?index.orValue(0.5)`. (Arithmetic across numeric types is not in this list: it
# fails at runtime, so the claim could never be allocated.)
_NUM = r"(?:int|uint|double)"
_LENIENT_TYPE_ERRORS = (
    re.compile(rf"found no matching overload for '_(?:<|<=|>|>=|==|!=)_' applied to '\({_NUM}, {_NUM}\)'"),
    re.compile(r"found no matching overload for '_(?:==|!=)_' applied to '\([^,()]+, null_type\)'"),
    re.compile(r"found no matching overload for '_(?:==|!=)_' applied to '\(null_type, [^,()]+\)'"),
    re.compile(rf"found no matching overload for 'orValue' applied to '\(optional_type\({_NUM}\), {_NUM}\)'"),
)
_TWO_VAR_LOOP = re.compile(
    r"\.\s*(?:all|exists|existsOne|transformList|transformMap|transformMapEntry)\s*\(\s*(\w+)\s*,\s*(\w+)\s*,"
)
_MACROS = re.compile(r"\.\s*(all|exists|exists_one|map|filter|transformList|transformMap)\s*\(")


def error_lines(text: str) -> list[tuple[str, str, str]]:
    """(row, column, message) of each error in a cel-cpp status text."""
    return _ERROR_LINE.findall(text)


def unmodelled_functions(expression: str, compile_error: str) -> list[str]:
    """The UNMODELLED_FUNCTIONS that alone keep `expression` from compiling, given cel-cpp's error
    text; empty when it fails for anything else too."""
    names = {a or b for a, b in _UNDECLARED.findall(compile_error)}
    known = names & UNMODELLED_FUNCTIONS
    rest = names - UNMODELLED_FUNCTIONS
    # A two-variable comprehension also leaves its loop variables undeclared.
    allowed = {v for pair in _TWO_VAR_LOOP.findall(expression) for v in pair}
    # Every error must come from those names (or cascade from them: an '*error*' type).
    others = [m for _, _, m in error_lines(compile_error) if not _UNDECLARED.search(m)]
    if known and not (rest - allowed) and all("'*error*'" in m for m in others):
        return sorted(known)
    return []


def is_lenient_type_error(message: str) -> bool:
    """A typed-check error that Kubernetes (attribute values are dyn) does not make."""
    return any(p.search(message) for p in _LENIENT_TYPE_ERRORS)


def estimate_cost(expression: str) -> int:
    """A conservative stand-in for cel-go's static cost estimate (cel-expr-python has none).

    Each token costs 1; a comprehension multiplies the cost of its body by the assumed size of the
    collection (32, the most attributes a device may have), so nested comprehensions grow as 32^depth,
    as they do in cel-go. String functions on unbounded strings are not modelled.
    """
    cost, mult = 0, 1
    stack: list[bool] = []
    tokens = re.finditer(
        r"\.\s*(?:all|exists|exists_one|map|filter|transformList|transformMap)\s*\(|[()]|"
        r"\"(?:[^\"\\]|\\.)*\"|'(?:[^'\\]|\\.)*'|[A-Za-z_][A-Za-z0-9_]*|\d+|\S",
        expression,
    )
    for tok in tokens:
        t = tok.group(0)
        if _MACROS.fullmatch(t):
            stack.append(True)
            mult *= MAX_MAP_SIZE
        elif t == "(":
            stack.append(False)
        elif t == ")" and stack and stack.pop():
            mult //= MAX_MAP_SIZE
        cost += mult
    return cost
