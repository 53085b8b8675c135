/* Replica masks (Python ints: bit i for the replica numbered i) as little-endian machine
 * words, for the cluster's C code (holder_table.c, cost_search.c; native.py keys their builds
 * by this file too). */
#ifndef PDSERVE_MASKS_H
#define PDSERVE_MASKS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define MAX_WORDS 64 /* masks of up to 4,096 replica bits */

/* Words enough for `v`'s bits and a sign bit; -1 with an error set. */
static inline Py_ssize_t words_for(PyObject *v) {
    if (!PyLong_Check(v)) {
        PyErr_SetString(PyExc_TypeError, "a mask is an int");
        return -1;
    }
#if PY_VERSION_HEX >= 0x030D0000
    Py_ssize_t bytes = PyLong_AsNativeBytes(v, NULL, 0, Py_ASNATIVEBYTES_LITTLE_ENDIAN);
    if (bytes < 0) return -1;
    return bytes / 8 + 1;
#else
    size_t bits = _PyLong_NumBits(v);
    if (bits == (size_t)-1 && PyErr_Occurred()) return -1;
    return (Py_ssize_t)(bits / 64 + 1);
#endif
}

/* `v` as `words` little-endian words, two's complement (a negative int sign-extends). */
static inline int to_words(PyObject *v, uint64_t *out, Py_ssize_t words) {
    if (!PyLong_Check(v)) {
        PyErr_SetString(PyExc_TypeError, "a mask is an int");
        return -1;
    }
#if PY_VERSION_HEX >= 0x030D0000
    Py_ssize_t need = PyLong_AsNativeBytes(v, out, words * 8, Py_ASNATIVEBYTES_LITTLE_ENDIAN);
    if (need < 0) return -1;
    if (need > words * 8) {
        PyErr_SetString(PyExc_OverflowError, "mask wider than its words");
        return -1;
    }
    return 0;
#else
    return _PyLong_AsByteArray((PyLongObject *)v, (unsigned char *)out, words * 8, 1, 1);
#endif
}

static inline PyObject *from_words(const uint64_t *mask, Py_ssize_t words) {
#if PY_VERSION_HEX >= 0x030D0000
    return PyLong_FromUnsignedNativeBytes(mask, words * 8, Py_ASNATIVEBYTES_LITTLE_ENDIAN);
#else
    return _PyLong_FromByteArray((const unsigned char *)mask, words * 8, 1, 0);
#endif
}

static inline int any_common(const uint64_t *a, const uint64_t *b, Py_ssize_t words) {
    for (Py_ssize_t k = 0; k < words; k++)
        if (a[k] & b[k]) return 1;
    return 0;
}

static inline int is_empty(const uint64_t *a, Py_ssize_t words) {
    for (Py_ssize_t k = 0; k < words; k++)
        if (a[k]) return 0;
    return 1;
}

/* The position of a one-bit int's bit (-1 for 0, or for a bit past `words` words: in none of
 * the masks searched); -2 with an error set. */
static inline Py_ssize_t bit_position(PyObject *bit, Py_ssize_t words) {
#if PY_VERSION_HEX < 0x030C0000
    /* A replica's bit is 1 << its number (the index's and `Holdings.of`'s numbering). Before
     * 3.12 an int's sign is its size's (3.12 keeps it in a tag Py_SIZE may not read). */
    if (PyLong_CheckExact(bit) && Py_SIZE(bit) >= 0) {
        size_t bits = _PyLong_NumBits(bit);
        return bits == 0 || bits > (size_t)words * 64 ? -1 : (Py_ssize_t)bits - 1;
    }
#endif
    uint64_t w[MAX_WORDS];
    if (to_words(bit, w, words) < 0) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) return -2;
        PyErr_Clear();
        return -1;
    }
    for (Py_ssize_t k = 0; k < words; k++)
        if (w[k]) return k * 64 + __builtin_ctzll(w[k]);
    return -1;
}

static inline int has_bit(const uint64_t *mask, Py_ssize_t position) {
    return position >= 0 && (mask[position / 64] >> (position % 64)) & 1;
}

#endif
