/* The routing searches' inner loop: `_Search.up_to_least` of deployments/cluster/kv_scoring.py
 * (the reference in Python, which the tests hold this to, result for result), and the
 * candidates' mask a ranking starts from.
 *
 * Why C: at 128 replicas a routing decision runs this search three or four times (the
 * Router's survey, then each leg's ranking), and in Python its big-int masks, tuples and
 * method calls took most of a decision (`pdserve bench router-sim`). Here masks are machine
 * words and a replica's cost is read straight off its Holding and EngineLoad.
 *
 * Costs are computed in the reference's order of operations, in doubles, so both give the
 * same floats. Where an input is not what the index hands out (a mask wider than MAX_WORDS
 * words, a mapping that is not a dict), the functions return NotImplemented and the caller
 * runs the reference.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "masks.h"

static PyObject *s_running, *s_waiting, *s_queued, *s_usage;

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

/* kv_cost.load_cost, the router's requests in flight read from `ongoing`; `holding` NULL for
 * a replica the index does not know (NOTHING_HELD). */
static int load_cost(const Search *s, PyObject *replica, PyObject *holding, double *out) {
    double ongoing = 0.0;
    if (s->ongoing) {
        PyObject *v = PyDict_GetItemWithError(s->ongoing, replica);
        if (v) {
            ongoing = PyFloat_AsDouble(v);
            if (ongoing == -1.0 && PyErr_Occurred()) return -1;
        } else if (PyErr_Occurred()) {
            return -1;
        }
    }
    PyObject *load = Py_None;
    if (holding) {
        if (!PyTuple_Check(holding) || PyTuple_GET_SIZE(holding) < 2) {
            PyErr_SetString(PyExc_TypeError, "a holding is a Holding");
            return -1;
        }
        load = PyTuple_GET_ITEM(holding, 1);
    }
    if (load == Py_None) {
        *out = s->request_tokens * (ongoing > 0.0 ? ongoing : 0.0);
        return 0;
    }
    double running, waiting, queued, usage;
    if (number(load, s_running, &running) < 0 || number(load, s_waiting, &waiting) < 0 ||
        number(load, s_queued, &queued) < 0 || number(load, s_usage, &usage) < 0)
        return -1;
    double engine = running + waiting;
    double cost = queued + s->request_tokens * (ongoing >= engine ? ongoing : engine);
    if (usage >= s->hot_kv_usage) cost += (double)s->prompt;
    *out = cost;
    return 0;
}

static int put_cost(Search *s, PyObject *replica, double cost) {
    PyObject *f = PyFloat_FromDouble(cost);
    if (!f) return -1;
    int rc = PyDict_SetItem(s->costs, replica, f);
    Py_DECREF(f);
    return rc;
}

/* _Walk.evaluate. */
static int evaluate(Search *s, PyObject *replica, PyObject *holding, double term) {
    double load;
    if (load_cost(s, replica, holding, &load) < 0) return -1;
    double cost = term + load;
    if (put_cost(s, replica, cost) < 0) return -1;
    if (cost < s->least) {
        s->least = cost;
        s->at_least = 1;
    } else if (cost == s->least) {
        s->at_least++;
    }
    return 0;
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

/* _Walk.along: the board's replicas of `alive`, least loaded first, each costing its kind's
 * term plus its load, until none left can cost less than the least found. */
static int walk(Search *s, PyObject *board, uint64_t *alive, Kind *kinds, Py_ssize_t n) {
    Py_ssize_t words = s->words;
    if (is_empty(alive, words) || n == 0) return 0;
    double lowest = kinds[0].term, least = s->least;
    int enough = s->at_least >= s->ties;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(board); i++) {
        PyObject *entry = PyTuple_GET_ITEM(board, i); /* (load_key, replica, bit) */
        if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 3) {
            PyErr_SetString(PyExc_TypeError, "a board entry is (load_key, replica, bit)");
            return -1;
        }
        double key = PyFloat_AsDouble(PyTuple_GET_ITEM(entry, 0));
        if (key == -1.0 && PyErr_Occurred()) return -1;
        double floor = key + lowest;
        if (floor > least || (floor == least && enough)) return 0;
        Py_ssize_t position = bit_position(PyTuple_GET_ITEM(entry, 2), words);
        if (position == -2) return -1;
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
        PyObject *replica = PyTuple_GET_ITEM(entry, 1);
        PyObject *holding = holding_of(s, replica);
        if (!holding || evaluate(s, replica, holding, kinds[k].term) < 0) return -1;
        least = s->least;
        enough = s->at_least >= s->ties;
        alive[position / 64] &= ~((uint64_t)1 << (position % 64));
        if (is_empty(alive, words)) return 0;
    }
    return 0;
}

static int as_ll(PyObject *v, long long *out) {
    *out = PyLong_AsLongLong(v);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

static int as_double(PyObject *v, double *out) {
    *out = PyFloat_AsDouble(v);
    return (*out == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

/* up_to_least(groups, big, board, replicas, bits, ongoing, eligible, alive, held_mask,
 *             unheard, one, prompt_tokens, block_size, lent_blocks,
 *             request_tokens, hot_kv_usage, tier_token_cost) -> (costs, least) */
static PyObject *up_to_least(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 17) {
        PyErr_SetString(PyExc_TypeError, "up_to_least takes 17 arguments");
        return NULL;
    }
    PyObject *groups = args[0], *big = args[1], *board = args[2], *replicas = args[3];
    PyObject *bits = args[4], *ongoing = args[5], *unheard = args[9];
    if (!PyTuple_Check(groups) || !PyTuple_Check(big) || !PyTuple_Check(board) ||
        !PyDict_Check(replicas) || !PyDict_Check(bits) || !PyTuple_Check(unheard) ||
        (ongoing != Py_None && !PyDict_Check(ongoing)))
        Py_RETURN_NOTIMPLEMENTED;
    Search s = {.replicas = replicas, .ongoing = ongoing == Py_None ? NULL : ongoing};
    s.least = Py_HUGE_VAL;
    int one = PyObject_IsTrue(args[10]);
    if (one < 0 || as_ll(args[11], &s.prompt) < 0 || as_ll(args[12], &s.block_size) < 0 ||
        as_ll(args[13], &s.lent) < 0 || as_double(args[14], &s.request_tokens) < 0 ||
        as_double(args[15], &s.hot_kv_usage) < 0 || as_double(args[16], &s.tier_token_cost) < 0)
        return NULL;
    s.ties = one ? 1 : 2;
    Py_ssize_t words = 1;
    for (int a = 6; a <= 8; a++) { /* eligible, alive, held_mask: every mask ands with these */
        Py_ssize_t w = words_for(args[a]);
        if (w < 0) return NULL;
        if (w > words) words = w;
    }
    if (words > MAX_WORDS) Py_RETURN_NOTIMPLEMENTED;
    s.words = words;
    uint64_t eligible[MAX_WORDS], alive[MAX_WORDS], held[MAX_WORDS];
    if (to_words(args[6], eligible, words) < 0 || to_words(args[7], alive, words) < 0 ||
        to_words(args[8], held, words) < 0)
        return NULL;
    s.costs = PyDict_New();
    if (!s.costs) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(big) + 1;
    Kind *kinds = PyMem_Malloc((size_t)n * sizeof(Kind));
    uint64_t *masks = PyMem_Malloc((size_t)(n * words) * 8);
    if (!kinds || !masks) {
        PyErr_NoMemory();
        goto fail;
    }
    if (small_groups(&s, groups, bits, eligible) < 0) goto fail;
    if (one && PyDict_GET_SIZE(s.costs)) { /* only a cheaper walked one counts */
        PyObject *key, *value;
        Py_ssize_t pos = 0;
        while (PyDict_Next(s.costs, &pos, &key, &value)) {
            double cost = PyFloat_AS_DOUBLE(value);
            if (cost < s.least) s.least = cost;
        }
        s.at_least = 1;
    }
    double nothing = cache_term(&s, 0, 0);
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(unheard); i++)
        if (evaluate(&s, PyTuple_GET_ITEM(unheard, i), NULL, nothing) < 0) goto fail;
    /* The kinds by rising term, in order where they tie (a stable insertion sort): the big
     * groups, then holding nothing (every bit no group holds). */
    for (Py_ssize_t i = 0; i < n; i++) {
        Kind kind = {.term = nothing, .mask = masks + i * words};
        if (i < n - 1) {
            PyObject *g = PyTuple_GET_ITEM(big, i);
            long long cached, tier;
            if (!PyTuple_Check(g) || PyTuple_GET_SIZE(g) != 4) {
                PyErr_SetString(PyExc_TypeError, "a group is a HeldGroup");
                goto fail;
            }
            if (as_ll(PyTuple_GET_ITEM(g, 0), &cached) < 0 ||
                as_ll(PyTuple_GET_ITEM(g, 1), &tier) < 0 ||
                to_words(PyTuple_GET_ITEM(g, 2), kind.mask, words) < 0)
                goto fail;
            kind.term = cache_term(&s, cached, tier);
        } else {
            for (Py_ssize_t w = 0; w < words; w++) kind.mask[w] = ~held[w];
        }
        Py_ssize_t j = i;
        while (j > 0 && kinds[j - 1].term > kind.term) kinds[j] = kinds[j - 1], j--;
        kinds[j] = kind;
    }
    if (walk(&s, board, alive, kinds, n) < 0) goto fail;
    PyMem_Free(kinds);
    PyMem_Free(masks);
    PyObject *least = PyFloat_FromDouble(s.least);
    if (!least) {
        Py_DECREF(s.costs);
        return NULL;
    }
    PyObject *result = PyTuple_Pack(2, s.costs, least);
    Py_DECREF(s.costs);
    Py_DECREF(least);
    return result;
fail:
    PyMem_Free(kinds);
    PyMem_Free(masks);
    Py_DECREF(s.costs);
    return NULL;
}

/* candidates_mask(candidates, bits, replicas) -> (mask, unheard): the or of the candidates'
 * bits (0 for one without), and those not in `replicas`, once each, in order. */
static PyObject *candidates_mask(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "candidates_mask takes 3 arguments");
        return NULL;
    }
    PyObject *bits = args[1], *replicas = args[2];
    if (!PyDict_Check(bits) || !PyDict_Check(replicas)) Py_RETURN_NOTIMPLEMENTED;
    PyObject *candidates = PySequence_Fast(args[0], "candidates are a sequence");
    if (!candidates) return NULL;
    uint64_t mask[MAX_WORDS] = {0};
    Py_ssize_t words = 1;
    PyObject *unheard = PyList_New(0), *seen = NULL, *result = NULL;
    if (!unheard) goto done;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(candidates); i++) {
        PyObject *replica = PySequence_Fast_GET_ITEM(candidates, i);
        PyObject *bit = PyDict_GetItemWithError(bits, replica);
        if (!bit && PyErr_Occurred()) goto done;
        if (bit) {
            Py_ssize_t need = words_for(bit);
            if (need < 0) goto done;
            if (need > MAX_WORDS) {
                Py_DECREF(candidates);
                Py_DECREF(unheard);
                Py_RETURN_NOTIMPLEMENTED;
            }
            if (need > words) words = need;
            Py_ssize_t position = bit_position(bit, words);
            if (position == -2) goto done;
            if (position >= 0) mask[position / 64] |= (uint64_t)1 << (position % 64);
        }
        int known = PyDict_Contains(replicas, replica);
        if (known < 0) goto done;
        if (known) continue;
        if (!seen && !(seen = PySet_New(NULL))) goto done;
        int again = PySet_Contains(seen, replica);
        if (again < 0 || (!again && (PySet_Add(seen, replica) < 0 ||
                                     PyList_Append(unheard, replica) < 0)))
            goto done;
    }
    PyObject *value = from_words(mask, words);
    if (value) {
        result = PyTuple_Pack(2, value, unheard);
        Py_DECREF(value);
    }
done:
    Py_DECREF(candidates);
    Py_XDECREF(unheard);
    Py_XDECREF(seen);
    return result;
}

static PyMethodDef methods[] = {
    {"up_to_least", (PyCFunction)(void (*)(void))up_to_least, METH_FASTCALL,
     "kv_scoring._Search.up_to_least over the holdings' parts: (costs, least)."},
    {"candidates_mask", (PyCFunction)(void (*)(void))candidates_mask, METH_FASTCALL,
     "candidates_mask(candidates, bits, replicas) -> (mask, unheard)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "pdserve_cost_search", NULL, -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit_pdserve_cost_search(void) {
    s_running = PyUnicode_InternFromString("num_running");
    s_waiting = PyUnicode_InternFromString("num_waiting");
    s_queued = PyUnicode_InternFromString("queued_prompt_tokens");
    s_usage = PyUnicode_InternFromString("kv_cache_usage");
    if (!s_running || !s_waiting || !s_queued || !s_usage) return NULL;
    return PyModule_Create(&module);
}
