/* The search of deployments/cluster/kv_scoring.py's `_Search.up_to_least` over one prompt's
 * holdings (kv_holdings.Holdings), for cost_search.c: small groups evaluated member by
 * member, the load board walked by kind. Costs are computed in the reference's order of
 * operations, in doubles, so both give the same floats. */
#ifndef PDSERVE_SEARCH_H
#define PDSERVE_SEARCH_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "board.h"
#include "masks.h"

/* Attribute names, interned once (module init: `intern_names`). */
static PyObject *s_running, *s_waiting, *s_queued, *s_usage;
static PyObject *s_groups, *s_big, *s_board, *s_roles, *s_replicas, *s_bits, *s_known, *s_held,
    *s_small;

/* ------------------------------------------------------------------ costs */

typedef struct {
    PyObject *costs;    /* dict: replica -> cost */
    PyObject *replicas; /* dict: replica -> Holding */
    PyObject *ongoing;  /* dict: replica -> requests in flight, or NULL */
    long long prompt, block_size, lent;
    double request_tokens, hot_kv_usage, tier_token_cost;
    double least;       /* the least cost of a walked replica */
    long long at_least; /* walked replicas costing `least` */
    long long ties;
    Py_ssize_t words;
} Search;

/* kv_cost.cache_term. */
static double cache_term(const Search *s, long long cached, long long tier) {
    if (s->lent > cached) cached = s->lent, tier = 0;
    long long uncached = s->prompt - cached * s->block_size;
    if (uncached < 0) uncached = 0;
    long long copied = tier * s->block_size;
    if (copied > s->prompt) copied = s->prompt;
    return (double)uncached + s->tier_token_cost * (double)copied;
}

static int number(PyObject *obj, PyObject *name, double *out) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (!v) return -1;
    *out = PyFloat_AsDouble(v);
    Py_DECREF(v);
    return (*out == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

/* The type whose instances are read by position (`set_load_type`: EngineLoad, a named tuple
 * whose first four fields are those below), or NULL. */
static PyObject *load_type;

/* An EngineLoad's (num_running, num_waiting, queued_prompt_tokens, kv_cache_usage): by
 * position where it is one (reading it by name, its instance dict's lookups were a third of
 * a ranking's time), else by name. */
static int load_numbers(PyObject *load, double *running, double *waiting, double *queued,
                        double *usage) {
    double *out[] = {running, waiting, queued, usage};
    PyObject *names[] = {s_running, s_waiting, s_queued, s_usage};
    int by_position = load_type && Py_IS_TYPE(load, (PyTypeObject *)load_type) &&
                      PyTuple_GET_SIZE(load) >= 4;
    for (Py_ssize_t i = 0; i < 4; i++) {
        if (!by_position) {
            if (number(load, names[i], out[i]) < 0) return -1;
            continue;
        }
        *out[i] = PyFloat_AsDouble(PyTuple_GET_ITEM(load, i));
        if (*out[i] == -1.0 && PyErr_Occurred()) return -1;
    }
    return 0;
}

/* The router's requests in flight at `replica` (0 where `ongoing` has none). */
static int ongoing_of(const Search *s, PyObject *replica, double *out) {
    *out = 0.0;
    if (!s->ongoing) return 0;
    PyObject *v = PyDict_GetItemWithError(s->ongoing, replica);
    if (!v) return PyErr_Occurred() ? -1 : 0;
    *out = PyFloat_AsDouble(v);
    return (*out == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

/* kv_cost.load_cost from a load's numbers (`reported` 0: no load reported). */
static double load_part(const Search *s, double ongoing, int reported, double engine,
                        double queued, double usage) {
    if (!reported) return s->request_tokens * (ongoing > 0.0 ? ongoing : 0.0);
    double cost = queued + s->request_tokens * (ongoing >= engine ? ongoing : engine);
    if (usage >= s->hot_kv_usage) cost += (double)s->prompt;
    return cost;
}

/* kv_cost.load_cost, the router's requests in flight read from `ongoing`; `holding` NULL for
 * a replica the index does not know (NOTHING_HELD). */
static int load_cost(const Search *s, PyObject *replica, PyObject *holding, double *out) {
    double ongoing;
    if (ongoing_of(s, replica, &ongoing) < 0) return -1;
    PyObject *load = Py_None;
    if (holding) {
        if (!PyTuple_Check(holding) || PyTuple_GET_SIZE(holding) < 2) {
            PyErr_SetString(PyExc_TypeError, "a holding is a Holding");
            return -1;
        }
        load = PyTuple_GET_ITEM(holding, 1);
    }
    double running = 0.0, waiting = 0.0, queued = 0.0, usage = 0.0;
    if (load != Py_None && load_numbers(load, &running, &waiting, &queued, &usage) < 0) return -1;
    *out = load_part(s, ongoing, load != Py_None, running + waiting, queued, usage);
    return 0;
}

static int put_cost(Search *s, PyObject *replica, double cost) {
    PyObject *f = PyFloat_FromDouble(cost);
    if (!f) return -1;
    int rc = PyDict_SetItem(s->costs, replica, f);
    Py_DECREF(f);
    return rc;
}

/* A walked replica's cost, kept (and the least so far). */
static int settle(Search *s, PyObject *replica, double cost) {
    if (put_cost(s, replica, cost) < 0) return -1;
    if (cost < s->least) {
        s->least = cost;
        s->at_least = 1;
    } else if (cost == s->least) {
        s->at_least++;
    }
    return 0;
}

/* _Walk.evaluate. */
static int evaluate(Search *s, PyObject *replica, PyObject *holding, double term) {
    double load;
    if (load_cost(s, replica, holding, &load) < 0) return -1;
    return settle(s, replica, term + load);
}

static PyObject *holding_of(Search *s, PyObject *replica) {
    PyObject *holding = PyDict_GetItemWithError(s->replicas, replica);
    if (!holding && !PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, replica);
    return holding;
}

/* Every eligible member of a small group, evaluated (not walked: they do not set `least`). */
static int small_groups(Search *s, PyObject *groups, PyObject *bits, const uint64_t *eligible) {
    uint64_t mask[MAX_WORDS];
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(groups); i++) {
        PyObject *g = PyTuple_GET_ITEM(groups, i); /* (cached, tier, mask, members) */
        if (!PyTuple_Check(g) || PyTuple_GET_SIZE(g) != 4) {
            PyErr_SetString(PyExc_TypeError, "a group is a HeldGroup");
            return -1;
        }
        PyObject *members = PyTuple_GET_ITEM(g, 3);
        if (!PyTuple_Check(members) || PyTuple_GET_SIZE(members) == 0) continue;
        if (to_words(PyTuple_GET_ITEM(g, 2), mask, s->words) < 0) return -1;
        if (!any_common(mask, eligible, s->words)) continue;
        long long cached = PyLong_AsLongLong(PyTuple_GET_ITEM(g, 0));
        long long tier = PyLong_AsLongLong(PyTuple_GET_ITEM(g, 1));
        if (PyErr_Occurred()) return -1;
        double term = cache_term(s, cached, tier);
        for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(members); j++) {
            PyObject *replica = PyTuple_GET_ITEM(members, j);
            PyObject *bit = PyDict_GetItemWithError(bits, replica);
            if (!bit) {
                if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, replica);
                return -1;
            }
            Py_ssize_t position = bit_position(bit, s->words);
            if (position == -2) return -1;
            if (!has_bit(eligible, position)) continue;
            PyObject *holding = holding_of(s, replica);
            double load;
            if (!holding || load_cost(s, replica, holding, &load) < 0) return -1;
            if (put_cost(s, replica, term + load) < 0) return -1;
        }
    }
    return 0;
}

typedef struct {
    double term;
    uint64_t *mask;
} Kind;

/* Evaluates entry `replica` of kind term `term`: from its record where packed, else from its
 * Holding. */
static int evaluate_entry(Search *s, PyObject *replica, const Record *record, int packed,
                          double term) {
    if (!packed) {
        PyObject *holding = holding_of(s, replica);
        return holding ? evaluate(s, replica, holding, term) : -1;
    }
    double ongoing;
    if (ongoing_of(s, replica, &ongoing) < 0) return -1;
    int reported = !isnan(record->busy);
    double load = load_part(s, ongoing, reported, record->busy, record->queued, record->usage);
    return settle(s, replica, term + load);
}

/* _Walk.along: the board's replicas of `alive`, least loaded first, each costing its kind's
 * term plus its load, until none left can cost less than the least found. */
static int walk(Search *s, const BoardView *v, uint64_t *alive, Kind *kinds, Py_ssize_t n) {
    Py_ssize_t words = s->words;
    if (is_empty(alive, words) || n == 0) return 0;
    double lowest = kinds[0].term, least = s->least;
    int enough = s->at_least >= s->ties;
    for (Py_ssize_t i = 0; i < v->n; i++) {
        double key;
        Py_ssize_t position;
        PyObject *replica;
        Record record;
        int packed;
        if (view_entry(v, i, words, &key, &position, &replica, &record, &packed) < 0) return -1;
        double floor = key + lowest;
        if (floor > least || (floor == least && enough)) return 0;
        if (!has_bit(alive, position)) continue;
        Py_ssize_t k = 0;
        while (k < n - 1 && !has_bit(kinds[k].mask, position)) k++; /* (the last: holds it) */
        floor = key + kinds[k].term;
        if (floor > least || (floor == least && enough)) {
            /* This kind is done: its later members are loaded more. */
            const uint64_t *done = kinds[k].mask;
            for (Py_ssize_t w = 0; w < words; w++) alive[w] &= ~done[w];
            Py_ssize_t kept = 0;
            for (Py_ssize_t j = 0; j < n; j++)
                if (memcmp(kinds[j].mask, done, (size_t)words * 8) != 0) kinds[kept++] = kinds[j];
            n = kept;
            if (is_empty(alive, words) || n == 0) return 0;
            lowest = kinds[0].term;
            continue;
        }
        if (evaluate_entry(s, replica, &record, packed, kinds[k].term) < 0) return -1;
        least = s->least;
        enough = s->at_least >= s->ties;
        alive[position / 64] &= ~((uint64_t)1 << (position % 64));
        if (is_empty(alive, words)) return 0;
    }
    return 0;
}

static int intern_names(void) {
    const char *names[] = {"num_running", "num_waiting", "queued_prompt_tokens", "kv_cache_usage",
                           "groups", "big", "board", "roles", "replicas", "bits", "known",
                           "held_mask", "small_mask", "packed", "names"};
    PyObject **slots[] = {&s_running, &s_waiting, &s_queued, &s_usage, &s_groups, &s_big,
                          &s_board, &s_roles, &s_replicas, &s_bits, &s_known, &s_held, &s_small,
                          &s_packed, &s_names};
    for (size_t i = 0; i < sizeof names / sizeof *names; i++)
        if (!(*slots[i] = PyUnicode_InternFromString(names[i]))) return -1;
    return 0;
}

/* One answer's parts (kv_holdings.Holdings), read once per call; new references. */
typedef struct {
    PyObject *groups, *big, *board, *roles, *replicas, *bits, *known, *held, *small;
} Parts;

static void parts_clear(Parts *p) {
    PyObject **slots[] = {&p->groups, &p->big, &p->board, &p->roles, &p->replicas,
                          &p->bits, &p->known, &p->held, &p->small};
    for (size_t i = 0; i < sizeof slots / sizeof *slots; i++) Py_CLEAR(*slots[i]);
}

/* 0: read; 1: not laid out as the index lays an answer out (the caller runs the reference);
 * -1: an error. */
static int parts_read(PyObject *holdings, Parts *p) {
    PyObject *names[] = {s_groups, s_big, s_board, s_roles, s_replicas, s_bits, s_known,
                         s_held, s_small};
    PyObject **slots[] = {&p->groups, &p->big, &p->board, &p->roles, &p->replicas,
                          &p->bits, &p->known, &p->held, &p->small};
    memset(p, 0, sizeof *p);
    for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
        if (!(*slots[i] = PyObject_GetAttr(holdings, names[i]))) {
            parts_clear(p);
            return -1;
        }
    }
    if (PyTuple_Check(p->groups) && PyTuple_Check(p->big) && PyTuple_Check(p->board) &&
        PyDict_Check(p->roles) && PyDict_Check(p->replicas) && PyDict_Check(p->bits) &&
        PyLong_Check(p->known) && PyLong_Check(p->held) && PyLong_Check(p->small))
        return 0;
    parts_clear(p);
    return 1;
}

/* Words enough for the answer's masks and `extra` (NULL: none); -1 with an error set. */
static Py_ssize_t parts_words(const Parts *p, PyObject *extra) {
    Py_ssize_t words = 1, w;
    PyObject *masks[] = {p->known, p->held, extra};
    for (size_t i = 0; i < 3 && masks[i]; i++) {
        if ((w = words_for(masks[i])) < 0) return -1;
        if (w > words) words = w;
    }
    Py_ssize_t pos = 0;
    PyObject *role, *entry;
    while (PyDict_Next(p->roles, &pos, &role, &entry)) { /* (mask, board) */
        if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 2) {
            PyErr_SetString(PyExc_TypeError, "a role is (mask, board)");
            return -1;
        }
        if ((w = words_for(PyTuple_GET_ITEM(entry, 0))) < 0) return -1;
        if (w > words) words = w;
    }
    return words;
}

/* Holdings.board_of: the board of the first role holding every `alive` replica, else all. */
static PyObject *board_of(const Parts *p, const uint64_t *alive, Py_ssize_t words) {
    uint64_t mask[MAX_WORDS];
    Py_ssize_t pos = 0;
    PyObject *role, *entry;
    while (PyDict_Next(p->roles, &pos, &role, &entry)) {
        if (to_words(PyTuple_GET_ITEM(entry, 0), mask, words) < 0) return NULL;
        int within = 1;
        for (Py_ssize_t w = 0; w < words && within; w++) within = !(alive[w] & ~mask[w]);
        if (within) return PyTuple_GET_ITEM(entry, 1);
    }
    return p->board;
}

/* _Search.up_to_least: `s->costs` and `s->least` for the `eligible` replicas and the
 * `unheard` ones (a tuple or list of names the answer does not know). */
static int search(Search *s, const Parts *p, const uint64_t *eligible, PyObject *unheard,
                  int one) {
    Py_ssize_t words = s->words, n = PyTuple_GET_SIZE(p->big) + 1;
    uint64_t alive[MAX_WORDS], held[MAX_WORDS], known[MAX_WORDS], small[MAX_WORDS];
    if (to_words(p->known, known, words) < 0 || to_words(p->held, held, words) < 0 ||
        to_words(p->small, small, words) < 0)
        return -1;
    for (Py_ssize_t w = 0; w < words; w++) alive[w] = eligible[w] & known[w] & ~small[w];
    s->ties = one ? 1 : 2;
    if (small_groups(s, p->groups, p->bits, eligible) < 0) return -1;
    if (one && PyDict_GET_SIZE(s->costs)) { /* only a cheaper walked one counts */
        PyObject *key, *value;
        Py_ssize_t pos = 0;
        while (PyDict_Next(s->costs, &pos, &key, &value))
            if (PyFloat_AS_DOUBLE(value) < s->least) s->least = PyFloat_AS_DOUBLE(value);
        s->at_least = 1;
    }
    double nothing = cache_term(s, 0, 0);
    PyObject **names = PySequence_Fast_ITEMS(unheard);
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(unheard); i++)
        if (evaluate(s, names[i], NULL, nothing) < 0) return -1;
    Kind *kinds = PyMem_Malloc((size_t)n * sizeof(Kind));
    uint64_t *masks = PyMem_Malloc((size_t)(n * words) * 8);
    int rc = -1;
    if (!kinds || !masks) {
        PyErr_NoMemory();
        goto done;
    }
    /* The kinds by rising term, in order where they tie (a stable insertion sort): the big
     * groups, then holding nothing (every bit no group holds). */
    for (Py_ssize_t i = 0; i < n; i++) {
        Kind kind = {.term = nothing, .mask = masks + i * words};
        if (i < n - 1) {
            PyObject *g = PyTuple_GET_ITEM(p->big, i);
            if (!PyTuple_Check(g) || PyTuple_GET_SIZE(g) != 4) {
                PyErr_SetString(PyExc_TypeError, "a group is a HeldGroup");
                goto done;
            }
            long long cached = PyLong_AsLongLong(PyTuple_GET_ITEM(g, 0));
            long long tier = PyLong_AsLongLong(PyTuple_GET_ITEM(g, 1));
            if (PyErr_Occurred() || to_words(PyTuple_GET_ITEM(g, 2), kind.mask, words) < 0)
                goto done;
            kind.term = cache_term(s, cached, tier);
        } else {
            for (Py_ssize_t w = 0; w < words; w++) kind.mask[w] = ~held[w];
        }
        Py_ssize_t j = i;
        while (j > 0 && kinds[j - 1].term > kind.term) kinds[j] = kinds[j - 1], j--;
        kinds[j] = kind;
    }
    BoardView view;
    PyObject *board = board_of(p, alive, words);
    if (board && view_open(board, &view) == 0) {
        rc = walk(s, &view, alive, kinds, n);
        view_close(&view);
    }
done:
    PyMem_Free(kinds);
    PyMem_Free(masks);
    return rc;
}

#endif
