/* The routing searches in C: `_Search.up_to_least` and `rank_by_cost` of
 * deployments/cluster/kv_scoring.py (the reference in Python, which the tests hold these to,
 * result for result). The search itself is in search.h, the board it walks in board.h, masks
 * as words in masks.h.
 *
 * Why C: at 128 replicas a routing decision runs this search three or four times (the
 * Router's survey, then each leg's ranking), and in Python its big-int masks, tuples and
 * method calls took most of a decision (`pdserve bench router-sim`). Here masks are machine
 * words and a replica's cost is read straight off its Holding and EngineLoad.
 *
 * Where an input is not what the index hands out (a mask wider than MAX_WORDS
 * words, a mapping that is not a dict), the functions return NotImplemented and the caller
 * runs the reference.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "masks.h"
#include "search.h"

/* The search's numbers from `args` (prompt_tokens, block_size, lent_blocks, request_tokens,
 * hot_kv_usage, tier_token_cost). */
static int read_numbers(Search *s, PyObject *const *args) {
    s->prompt = PyLong_AsLongLong(args[0]);
    s->block_size = PyLong_AsLongLong(args[1]);
    s->lent = PyLong_AsLongLong(args[2]);
    s->request_tokens = PyFloat_AsDouble(args[3]);
    s->hot_kv_usage = PyFloat_AsDouble(args[4]);
    s->tier_token_cost = PyFloat_AsDouble(args[5]);
    return PyErr_Occurred() ? -1 : 0;
}

/* A search over `holdings` (read into `p`), `ongoing` a dict or None: 0 ready, 1 not an
 * input this takes (NotImplemented), -1 an error. */
static int start(Search *s, Parts *p, PyObject *holdings, PyObject *ongoing, PyObject *extra,
                 PyObject *const *numbers) {
    if (ongoing != Py_None && !PyDict_Check(ongoing)) return 1;
    int rc = parts_read(holdings, p);
    if (rc) return rc;
    memset(s, 0, sizeof *s);
    s->replicas = p->replicas;
    s->ongoing = ongoing == Py_None ? NULL : ongoing;
    s->least = Py_HUGE_VAL;
    s->words = parts_words(p, extra);
    if (s->words < 0 || read_numbers(s, numbers) < 0) rc = -1;
    else if (s->words > MAX_WORDS) rc = 1;
    else if (!(s->costs = PyDict_New())) rc = -1;
    if (rc) parts_clear(p);
    return rc;
}

static PyObject *finish(Search *s, Parts *p, PyObject *result) {
    Py_XDECREF(s->costs);
    parts_clear(p);
    return result;
}

/* up_to_least(holdings, ongoing, eligible, unheard, one, prompt_tokens, block_size,
 *             lent_blocks, request_tokens, hot_kv_usage, tier_token_cost) -> (costs, least) */
static PyObject *up_to_least(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 11 || !PyTuple_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "up_to_least takes 11 arguments (unheard: a tuple)");
        return NULL;
    }
    Search s;
    Parts p;
    int rc = start(&s, &p, args[0], args[1], args[2], args + 5);
    if (rc) return rc < 0 ? NULL : Py_NewRef(Py_NotImplemented);
    uint64_t eligible[MAX_WORDS];
    int one = PyObject_IsTrue(args[4]);
    if (one < 0 || to_words(args[2], eligible, s.words) < 0 ||
        search(&s, &p, eligible, args[3], one) < 0)
        return finish(&s, &p, NULL);
    PyObject *least = PyFloat_FromDouble(s.least);
    PyObject *result = least ? PyTuple_Pack(2, s.costs, least) : NULL;
    Py_XDECREF(least);
    return finish(&s, &p, result);
}

/* Of (key, replica) and a candidate, the less (by key, then name) into *key, *best. */
static int keep_least(double *key, PyObject **best, double k, PyObject *replica) {
    if (*best) {
        if (k > *key) return 0;
        if (k == *key) {
            int less = PyObject_RichCompareBool(replica, *best, Py_LT);
            if (less <= 0) return less;
        }
    }
    *key = k, *best = replica;
    return 0;
}

/* cheapest(holdings, eligible, prompt_tokens, block_size, lent_blocks, request_tokens,
 *          hot_kv_usage, tier_token_cost) -> replica or None: of the `eligible` replicas, the
 * cheapest by their own reported loads (of equals, the first by name; kv_scoring's
 * cheapest_held). */
static PyObject *cheapest(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "cheapest takes 8 arguments");
        return NULL;
    }
    Search s;
    Parts p;
    int rc = start(&s, &p, args[0], Py_None, args[1], args + 2);
    if (rc) return rc < 0 ? NULL : Py_NewRef(Py_NotImplemented);
    uint64_t eligible[MAX_WORDS];
    PyObject *none = PyTuple_New(0);
    if (!none || to_words(args[1], eligible, s.words) < 0 ||
        search(&s, &p, eligible, none, 1) < 0) {
        Py_XDECREF(none);
        return finish(&s, &p, NULL);
    }
    Py_DECREF(none);
    double key = 0.0;
    PyObject *best = NULL, *replica, *cost;
    Py_ssize_t pos = 0;
    while (PyDict_Next(s.costs, &pos, &replica, &cost))
        if (keep_least(&key, &best, PyFloat_AS_DOUBLE(cost), replica) < 0)
            return finish(&s, &p, NULL);
    return finish(&s, &p, Py_NewRef(best ? best : Py_None));
}

/* The candidates' bits (and the answer's `known`), each one's bit position in `positions`
 * (-1 for none), and those the answer does not know, once each, in order (a new list in
 * *unheard). A candidate whose bit is known is in the answer's replicas (`known` is their
 * bits): only the others are looked up there. */
static int candidates_of(const Search *s, const Parts *p, PyObject *candidates,
                         uint64_t *eligible, Py_ssize_t *positions, PyObject **unheard) {
    uint64_t known[MAX_WORDS];
    PyObject *seen = NULL;
    memset(eligible, 0, (size_t)s->words * 8);
    if (to_words(p->known, known, s->words) < 0 || !(*unheard = PyList_New(0))) return -1;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(candidates); i++) {
        PyObject *replica = PySequence_Fast_ITEMS(candidates)[i];
        PyObject *bit = PyDict_GetItemWithError(p->bits, replica);
        if (!bit && PyErr_Occurred()) goto fail;
        Py_ssize_t position = positions[i] = bit ? bit_position(bit, s->words) : -1;
        if (position == -2) goto fail;
        if (position >= 0) eligible[position / 64] |= (uint64_t)1 << (position % 64);
        int heard = has_bit(known, position);
        if (!heard && (heard = PyDict_Contains(p->replicas, replica)) < 0) goto fail;
        if (heard) continue;
        if (!seen && !(seen = PySet_New(NULL))) goto fail;
        int again = PySet_Contains(seen, replica);
        if (again < 0 ||
            (!again && (PySet_Add(seen, replica) < 0 || PyList_Append(*unheard, replica) < 0)))
            goto fail;
    }
    for (Py_ssize_t w = 0; w < s->words; w++) eligible[w] &= known[w];
    Py_XDECREF(seen);
    return 0;
fail:
    Py_XDECREF(seen);
    Py_CLEAR(*unheard);
    return -1;
}

/* kv_scoring._tells_apart: 1 where the cache tells the candidates apart, 0 where not, -1. */
static int tells_apart(const Search *s, const Parts *p, const uint64_t *eligible, int unheard) {
    uint64_t mask[MAX_WORDS], held[MAX_WORDS];
    long long deepest = 0, groups = 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(p->groups); i++) {
        PyObject *g = PyTuple_GET_ITEM(p->groups, i);
        if (!PyTuple_Check(g) || PyTuple_GET_SIZE(g) != 4) {
            PyErr_SetString(PyExc_TypeError, "a group is a HeldGroup");
            return -1;
        }
        if (to_words(PyTuple_GET_ITEM(g, 2), mask, s->words) < 0) return -1;
        if (!any_common(mask, eligible, s->words)) continue;
        long long cached = PyLong_AsLongLong(PyTuple_GET_ITEM(g, 0));
        if (cached == -1 && PyErr_Occurred()) return -1;
        if (cached > deepest) deepest = cached;
        groups++;
    }
    if (deepest <= s->lent) return 0;
    if (unheard) return 1; /* one holds nothing, another more than the loan */
    if (to_words(p->held, held, s->words) < 0) return -1;
    for (Py_ssize_t w = 0; w < s->words; w++)
        if (eligible[w] & ~held[w]) return 1;
    return groups > 1; /* (a group: the replicas holding alike) */
}

typedef struct {
    double cost;
    PyObject *replica;
} Ranked;

static int by_cost(const void *a, const void *b) {
    double x = ((const Ranked *)a)->cost, y = ((const Ranked *)b)->cost;
    return (x > y) - (x < y);
}

/* Marks `replica` ranked: its bit in `bits_ranked`, or (without a bit) in the set *others. */
static int mark_ranked(const Search *s, const Parts *p, PyObject *replica, uint64_t *bits_ranked,
                       PyObject **others) {
    PyObject *bit = PyDict_GetItemWithError(p->bits, replica);
    if (!bit && PyErr_Occurred()) return -1;
    Py_ssize_t position = bit ? bit_position(bit, s->words) : -1;
    if (position == -2) return -1;
    if (position >= 0) {
        bits_ranked[position / 64] |= (uint64_t)1 << (position % 64);
        return 0;
    }
    if (!*others && !(*others = PySet_New(NULL))) return -1;
    return PySet_Add(*others, replica);
}

/* rank_by_cost's ranks from the search: the costs up to the least walked one, in ranks of
 * equal cost by name, then every other candidate in one last rank (the candidates told
 * apart from the ranked ones by bit, `positions` from candidates_of). */
static PyObject *ranks_of(const Search *s, const Parts *p, PyObject *candidates,
                          const Py_ssize_t *positions) {
    Py_ssize_t n = 0, pos = 0;
    PyObject *key, *value;
    uint64_t bits_ranked[MAX_WORDS] = {0};
    Ranked *ranked = PyMem_Malloc((size_t)(PyDict_GET_SIZE(s->costs) + 1) * sizeof(Ranked));
    PyObject *ranks = PyList_New(0), *others = NULL, *rest = NULL;
    if (!ranked) PyErr_NoMemory();
    if (!ranked || !ranks) goto fail;
    while (PyDict_Next(s->costs, &pos, &key, &value))
        if (PyFloat_AS_DOUBLE(value) <= s->least)
            ranked[n++] = (Ranked){PyFloat_AS_DOUBLE(value), key};
    qsort(ranked, (size_t)n, sizeof(Ranked), by_cost);
    for (Py_ssize_t i = 0, j; i < n; i = j) {
        PyObject *rank = PyList_New(0);
        if (!rank) goto fail;
        for (j = i; j < n && ranked[j].cost == ranked[i].cost; j++) {
            if (PyList_Append(rank, ranked[j].replica) < 0 ||
                mark_ranked(s, p, ranked[j].replica, bits_ranked, &others) < 0) {
                Py_DECREF(rank);
                goto fail;
            }
        }
        int rc = PyList_Sort(rank) < 0 ? -1 : PyList_Append(ranks, rank);
        Py_DECREF(rank);
        if (rc < 0) goto fail;
    }
    if (!(rest = PyList_New(0))) goto fail;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(candidates); i++) {
        PyObject *replica = PySequence_Fast_ITEMS(candidates)[i];
        int in = positions[i] >= 0 ? has_bit(bits_ranked, positions[i])
                 : others         ? PySet_Contains(others, replica)
                                  : 0;
        if (in < 0 || (!in && PyList_Append(rest, replica) < 0)) goto fail;
    }
    if (PyList_GET_SIZE(rest) && PyList_Append(ranks, rest) < 0) goto fail;
    Py_DECREF(rest);
    Py_XDECREF(others);
    PyMem_Free(ranked);
    return ranks;
fail:
    Py_XDECREF(rest);
    Py_XDECREF(others);
    Py_XDECREF(ranks);
    PyMem_Free(ranked);
    return NULL;
}

/* rank(candidates, holdings, ongoing, prompt_tokens, block_size, lent_blocks,
 *      request_tokens, hot_kv_usage, tier_token_cost) -> ranks, or None (kv_scoring's
 * rank_by_cost). */
static PyObject *rank(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "rank takes 9 arguments");
        return NULL;
    }
    PyObject *candidates = PySequence_Fast(args[0], "candidates are a sequence");
    if (!candidates) return NULL;
    Search s;
    Parts p;
    int rc = start(&s, &p, args[1], args[2], NULL, args + 3);
    if (rc) {
        Py_DECREF(candidates);
        return rc < 0 ? NULL : Py_NewRef(Py_NotImplemented);
    }
    uint64_t eligible[MAX_WORDS];
    PyObject *unheard = NULL, *result = NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(candidates);
    Py_ssize_t *positions = PyMem_Malloc((size_t)(count ? count : 1) * sizeof(Py_ssize_t));
    if (!positions) {
        PyErr_NoMemory();
        goto done;
    }
    if (candidates_of(&s, &p, candidates, eligible, positions, &unheard) < 0) goto done;
    int apart = tells_apart(&s, &p, eligible, PyList_GET_SIZE(unheard) > 0);
    if (apart < 0) goto done;
    if (!apart) {
        result = Py_NewRef(Py_None); /* load alone decides */
        goto done;
    }
    if (search(&s, &p, eligible, unheard, 0) == 0) result = ranks_of(&s, &p, candidates, positions);
done:
    PyMem_Free(positions);
    Py_XDECREF(unheard);
    Py_DECREF(candidates);
    return finish(&s, &p, result);
}

/* Whether `replica` can lend (its Holding names a side channel): 1, 0, or -1. */
static int lends_of(const Parts *p, PyObject *replica) {
    PyObject *holding = PyDict_GetItemWithError(p->replicas, replica);
    if (!holding) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, replica);
        return -1;
    }
    if (!PyTuple_Check(holding) || PyTuple_GET_SIZE(holding) < 4) {
        PyErr_SetString(PyExc_TypeError, "a holding is a Holding");
        return -1;
    }
    return PyObject_IsTrue(PyTuple_GET_ITEM(holding, 3));
}

/* kv_scoring._least_lender into keep_least: the group's least loaded member with a side
 * channel (a big group's: the first on the board). */
static int least_lender(const Parts *p, PyObject *group, double request_tokens,
                        Py_ssize_t words, double *key, PyObject **best) {
    PyObject *members = PyTuple_GET_ITEM(group, 3);
    if (!PyTuple_Check(members)) {
        PyErr_SetString(PyExc_TypeError, "a group is a HeldGroup");
        return -1;
    }
    if (PyTuple_GET_SIZE(members) == 0) { /* a big group */
        uint64_t mask[MAX_WORDS];
        if (to_words(PyTuple_GET_ITEM(group, 2), mask, words) < 0) return -1;
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(p->board); i++) {
            PyObject *entry = PyTuple_GET_ITEM(p->board, i); /* (load_key, replica, bit) */
            if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 3) {
                PyErr_SetString(PyExc_TypeError, "a board entry is (load_key, replica, bit)");
                return -1;
            }
            Py_ssize_t position = bit_position(PyTuple_GET_ITEM(entry, 2), words);
            if (position == -2) return -1;
            if (!has_bit(mask, position)) continue;
            PyObject *replica = PyTuple_GET_ITEM(entry, 1);
            int lends = lends_of(p, replica);
            if (lends < 0) return -1;
            if (!lends) continue;
            double k = PyFloat_AsDouble(PyTuple_GET_ITEM(entry, 0));
            return k == -1.0 && PyErr_Occurred() ? -1 : keep_least(key, best, k, replica);
        }
        return 0;
    }
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(members); j++) {
        PyObject *replica = PyTuple_GET_ITEM(members, j);
        int lends = lends_of(p, replica);
        if (lends < 0) return -1;
        if (!lends) continue;
        PyObject *holding = PyDict_GetItem(p->replicas, replica); /* (there: lends_of) */
        double k = 0.0, running, waiting, queued; /* kv_cost.load_key */
        PyObject *load = PyTuple_GET_ITEM(holding, 1);
        if (load != Py_None) {
            if (number(load, s_running, &running) < 0 || number(load, s_waiting, &waiting) < 0 ||
                number(load, s_queued, &queued) < 0)
                return -1;
            k = queued + request_tokens * (running + waiting);
        }
        if (keep_least(key, best, k, replica) < 0) return -1;
    }
    return 0;
}

/* most_held(holdings, request_tokens) -> (blocks, replica) or None: kv_scoring._most_held,
 * the replica that can lend holding the most of the prompt (of equals, the least loaded by
 * its report, then the first by name). */
static PyObject *most_held(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "most_held takes 2 arguments");
        return NULL;
    }
    Parts p;
    int rc = parts_read(args[0], &p);
    if (rc) return rc < 0 ? NULL : Py_NewRef(Py_NotImplemented);
    PyObject *result = NULL;
    double request_tokens = PyFloat_AsDouble(args[1]);
    Py_ssize_t words = parts_words(&p, NULL), n = PyTuple_GET_SIZE(p.groups);
    if ((request_tokens == -1.0 && PyErr_Occurred()) || words < 0) goto done;
    if (words > MAX_WORDS) {
        result = Py_NewRef(Py_NotImplemented);
        goto done;
    }
    long long above = -1; /* depths are taken deepest first, each below the last */
    for (;;) {
        long long depth = -1;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *g = PyTuple_GET_ITEM(p.groups, i);
            if (!PyTuple_Check(g) || PyTuple_GET_SIZE(g) != 4) {
                PyErr_SetString(PyExc_TypeError, "a group is a HeldGroup");
                goto done;
            }
            long long cached = PyLong_AsLongLong(PyTuple_GET_ITEM(g, 0));
            if (cached == -1 && PyErr_Occurred()) goto done;
            if (cached > depth && (above < 0 || cached < above)) depth = cached;
        }
        if (depth < 0) {
            result = Py_NewRef(Py_None);
            goto done;
        }
        double key = 0.0;
        PyObject *best = NULL;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *g = PyTuple_GET_ITEM(p.groups, i);
            if (PyLong_AsLongLong(PyTuple_GET_ITEM(g, 0)) != depth) continue;
            if (least_lender(&p, g, request_tokens, words, &key, &best) < 0) goto done;
        }
        if (best) {
            result = Py_BuildValue("(LO)", depth, best);
            goto done;
        }
        above = depth;
    }
done:
    parts_clear(&p);
    return result;
}

/* set_load_type(type): a tuple type whose first four fields are an EngineLoad's, read by
 * position from now on (cost_search.native() passes EngineLoad). */
static PyObject *set_load_type(PyObject *Py_UNUSED(self), PyObject *type) {
    if (!PyType_Check(type) || !PyType_IsSubtype((PyTypeObject *)type, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "a load type is a tuple type");
        return NULL;
    }
    Py_XSETREF(load_type, Py_NewRef(type));
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"set_load_type", set_load_type, METH_O, "set_load_type(EngineLoad): read by position."},
    {"up_to_least", (PyCFunction)(void (*)(void))up_to_least, METH_FASTCALL,
     "kv_scoring._Search.up_to_least over a Holdings: (costs, least)."},
    {"rank", (PyCFunction)(void (*)(void))rank, METH_FASTCALL,
     "kv_scoring.rank_by_cost over a Holdings: ranks, or None."},
    {"cheapest", (PyCFunction)(void (*)(void))cheapest, METH_FASTCALL,
     "kv_scoring.cheapest_held's choice over a Holdings: a replica, or None."},
    {"most_held", (PyCFunction)(void (*)(void))most_held, METH_FASTCALL,
     "kv_scoring._most_held over a Holdings: (blocks, replica), or None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "pdserve_cost_search", NULL, -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit_pdserve_cost_search(void) {
    if (intern_names() < 0) return NULL;
    return PyModule_Create(&module);
}
