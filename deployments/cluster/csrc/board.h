/* A load board as the routing search walks it (search.h): by record where the board is
 * packed (deployments/cluster/load_board.py's PackedBoard: every replica's key, bit and load
 * in one bytes object, not on a page each), else by its (load_key, replica, bit) tuples. */
#ifndef PDSERVE_BOARD_H
#define PDSERVE_BOARD_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "masks.h"

/* PackedBoard's attribute names, interned with search.h's (`intern_names`). */
static PyObject *s_packed, *s_names;

/* load_board.RECORD ("<ddddq"): an entry's load_key, its engine's running + waiting requests
 * (NaN: no load reported), queued prompt tokens, KV usage, and its bit's position. */
typedef struct {
    double key, busy, queued, usage;
    int64_t position;
} Record;

/* A board as the walk reads it: its records where it is packed (load_board.PackedBoard: the
 * replicas' keys, bits and loads in one bytes object, not on a page each), else its entry
 * tuples and each replica's Holding. */
typedef struct {
    PyObject *board, *packed, *names; /* packed and names: new references, or NULL */
    Py_ssize_t n;
} BoardView;

static void view_close(BoardView *v) {
    Py_CLEAR(v->packed);
    Py_CLEAR(v->names);
}

/* 0: opened (packed or not); -1: an error. */
static int view_open(PyObject *board, BoardView *v) {
    memset(v, 0, sizeof *v);
    if (!PyTuple_Check(board)) {
        PyErr_SetString(PyExc_TypeError, "a board is a tuple");
        return -1;
    }
    v->board = board;
    v->n = PyTuple_GET_SIZE(board);
#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
    return 0; /* the records are little-endian (RECORD's "<"): read the entries instead */
#endif
    if (PyTuple_CheckExact(board)) return 0;
    v->packed = PyObject_GetAttr(board, s_packed);
    v->names = v->packed ? PyObject_GetAttr(board, s_names) : NULL;
    if (!v->names) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
            view_close(v);
            return -1;
        }
        PyErr_Clear(); /* a tuple of another kind: its entries */
    }
    int laid_out = v->names && PyBytes_CheckExact(v->packed) && PyTuple_CheckExact(v->names) &&
                   PyTuple_GET_SIZE(v->names) == v->n &&
                   PyBytes_GET_SIZE(v->packed) == v->n * (Py_ssize_t)sizeof(Record);
    if (!laid_out) view_close(v);
    return 0;
}

/* Entry `i`'s key, bit position (-1 past the masks' words) and replica (borrowed); with
 * `record`, its packed record (NULL where the board is not packed). */
static int view_entry(const BoardView *v, Py_ssize_t i, Py_ssize_t words, double *key,
                      Py_ssize_t *position, PyObject **replica, Record *record, int *packed) {
    *packed = v->packed != NULL;
    if (*packed) {
        memcpy(record, PyBytes_AS_STRING(v->packed) + i * (Py_ssize_t)sizeof(Record),
               sizeof(Record));
        *key = record->key;
        int within = record->position >= 0 && record->position < (int64_t)words * 64;
        *position = within ? (Py_ssize_t)record->position : -1;
        *replica = PyTuple_GET_ITEM(v->names, i);
        return 0;
    }
    PyObject *entry = PyTuple_GET_ITEM(v->board, i); /* (load_key, replica, bit) */
    if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 3) {
        PyErr_SetString(PyExc_TypeError, "a board entry is (load_key, replica, bit)");
        return -1;
    }
    *key = PyFloat_AsDouble(PyTuple_GET_ITEM(entry, 0));
    if (*key == -1.0 && PyErr_Occurred()) return -1;
    *position = bit_position(PyTuple_GET_ITEM(entry, 2), words);
    if (*position == -2) return -1;
    *replica = PyTuple_GET_ITEM(entry, 1);
    return 0;
}

#endif
