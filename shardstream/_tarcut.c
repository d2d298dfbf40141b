/* Cut an indexed shard's samples out of a piece of tar stream, in C: the raw-read hot path.
 *
 * `shardstream.reader` reads a run of samples as one piece of the shard file. For a
 * .tar.zst shard each zstd frame is decompressed (`frame_samples`), for a plain .tar
 * the piece is the tar stream (`cut_samples`); then every sample's members are parsed
 * and each field copied into its own `bytes`. In Python that cost about 64 us a sample
 * on the benchmark's 114 KB photos: a fresh 1 MB buffer per frame (page faults on this
 * kind of VM), a Python header parse per member, and the copies. Here a frame is
 * decompressed into a buffer this thread reuses, with the GIL released, and the members
 * are cut out of it straight into their `bytes`. BENCHMARKS.md has the figures.
 *
 * Only the common layout is handled: regular ustar members with short names, each
 * `<key>.<field>` for the key the index gives, and nothing else in the sample's bytes.
 * For anything else the functions return None, and the reader parses the piece in
 * Python (`tario.iter_members`), which handles every layout and raises the precise
 * error. So this module may refuse more than the Python parser, never accept more:
 * tests/test_format.py reads damaged and unusual shards both ways and compares.
 *
 * libzstd: its header where installed, else the few declarations of its stable API
 * below; the build links the runtime library, libzstd.so.1, which nearly every Linux
 * has. Where this module does not build, the reader uses python-zstandard.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__has_include)
#if __has_include(<zstd.h>)
#include <zstd.h>
#define HAVE_ZSTD_H 1
#endif
#endif
#ifndef HAVE_ZSTD_H
typedef struct ZSTD_DCtx_s ZSTD_DCtx;
ZSTD_DCtx *ZSTD_createDCtx(void);
size_t ZSTD_freeDCtx(ZSTD_DCtx *dctx);
size_t ZSTD_decompressDCtx(ZSTD_DCtx *dctx, void *dst, size_t dst_capacity, const void *src, size_t src_size);
size_t ZSTD_findFrameCompressedSize(const void *src, size_t src_size);
unsigned ZSTD_isError(size_t code);
const char *ZSTD_getErrorName(size_t code);
#endif

#define BLOCK 512
#define MAX_MEMBER_SIZE ((int64_t)1 << 31) /* as tario.MAX_MEMBER_SIZE */
#define KEEP_SCRATCH ((size_t)16 << 20)    /* a larger buffer (one huge frame) is freed after use */

static PyObject *FrameError;
static PyObject *KEY, *URL; /* "__key__", "__url__" */

/* -- parsing --------------------------------------------------------------------------- */

/* A tar number field as `tario._number` reads it, in its common form: spaces, octal
 * digits, then NULs or spaces. -1 for anything else (base-256, stray characters). */
static int64_t octal(const unsigned char *field, int width)
{
    int i = 0;
    int64_t value = 0;
    while (i < width && field[i] == ' ')
        i++;
    for (; i < width && field[i] >= '0' && field[i] <= '7'; i++) {
        value = value * 8 + (field[i] - '0');
    }
    for (; i < width; i++) {
        if (field[i] != 0 && field[i] != ' ')
            return -1;
    }
    return value;
}

/* Whether a header's checksum is right, in tarfile's layout (six octal digits, NUL,
 * space); 0 for another layout too, which the Python parser then judges. */
static int checksum_ok(const unsigned char *h)
{
    int64_t stored = 0, sum = 256; /* the checksum field counts as eight spaces */
    int i;
    if (h[154] != 0 || h[155] != ' ')
        return 0;
    for (i = 148; i < 154; i++) {
        if (h[i] < '0' || h[i] > '7')
            return 0;
        stored = stored * 8 + (h[i] - '0');
    }
    for (i = 0; i < 148; i++)
        sum += h[i];
    for (i = 156; i < BLOCK; i++)
        sum += h[i];
    return stored == sum;
}

/* Whether `key` (UTF-8) has a dot after its last slash: then no member name splits
 * back into it, and the Python parser decides. */
static int dotted(const char *key, Py_ssize_t n)
{
    Py_ssize_t i;
    for (i = n - 1; i >= 0 && key[i] != '/'; i--) {
        if (key[i] == '.')
            return 1;
    }
    return 0;
}

/* One sample: the members in buf[pos, end) into a new dict, or Py_None (a new
 * reference) where the layout is not the common one, or NULL with an exception set. */
/* Whether the `n` bytes at `s` may change when lower-cased: an ASCII upper-case letter, or
 * any non-ASCII byte (Python's str.lower() lower-cases beyond ASCII). */
static int may_lower(const unsigned char *s, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        if ((s[i] >= 'A' && s[i] <= 'Z') || s[i] >= 0x80)
            return 1;
    }
    return 0;
}

static PyObject *cut_one(const unsigned char *buf, Py_ssize_t pos, Py_ssize_t end, PyObject *key, PyObject *url,
                         int verify)
{
    Py_ssize_t key_len, name_len;
    const char *key_utf8 = PyUnicode_AsUTF8AndSize(key, &key_len);
    PyObject *sample = NULL, *field = NULL, *data = NULL;
    int members = 0;

    if (key_utf8 == NULL) {
        /* A lone surrogate: no member name matches it, and the Python parser says so. */
        if (!PyErr_ExceptionMatches(PyExc_UnicodeEncodeError))
            return NULL;
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    /* A key ending in a slash makes members with an empty basename before the dot, which
       belong to no sample (`tario.member_key`): the Python parser says so. */
    if (key_len == 0 || key_utf8[key_len - 1] == '/' || dotted(key_utf8, key_len))
        Py_RETURN_NONE;
    sample = PyDict_New();
    if (sample == NULL || PyDict_SetItem(sample, KEY, key) < 0 || PyDict_SetItem(sample, URL, url) < 0)
        goto error;
    while (pos < end) {
        const unsigned char *h = buf + pos;
        const unsigned char *nul;
        int64_t size;
        if (end - pos < BLOCK || h[0] == 0 || h[156] != '0' || h[345] != 0 || memcmp(h + 257, "ustar", 5) != 0)
            goto other;
        if (h[124] == 0x80 || (size = octal(h + 124, 12)) < 0 || size > MAX_MEMBER_SIZE)
            goto other;
        if (verify && !checksum_ok(h))
            goto other;
        nul = memchr(h, 0, 100);
        name_len = nul ? (Py_ssize_t)(nul - h) : 100;
        /* `<key>.<field>`, the field without a slash: then the first dot after the name's
         * last slash is the one after the key, as `tario.member_key` splits it. A field
         * that lower-casing may change (as that does) is left to it too. */
        if (name_len < key_len + 2 || memcmp(h, key_utf8, key_len) != 0 || h[key_len] != '.' ||
            memchr(h + key_len + 1, '/', name_len - key_len - 1) != NULL ||
            may_lower(h + key_len + 1, name_len - key_len - 1) ||
            (name_len - key_len - 1 >= 2 && h[key_len + 1] == '_' && h[key_len + 2] == '_'))
            goto other; /* (a field beginning with "__" is refused there: `tario.check_new_field`) */
        if ((Py_ssize_t)size > end - pos - BLOCK)
            goto other;
        field = PyUnicode_DecodeUTF8((const char *)h + key_len + 1, name_len - key_len - 1, NULL);
        if (field == NULL) {
            PyErr_Clear(); /* not UTF-8: the Python parser names the error */
            goto other;
        }
        /* Not interned: Python 3.12 makes interned strings immortal, so every distinct
         * field name of a shard would be kept for the life of the process. */
        if (PyDict_Contains(sample, field) != 0) /* twice (or an error): the Python parser says which */
            goto other;
        data = PyBytes_FromStringAndSize((const char *)h + BLOCK, (Py_ssize_t)size);
        if (data == NULL || PyDict_SetItem(sample, field, data) < 0)
            goto error;
        Py_CLEAR(field);
        Py_CLEAR(data);
        members++;
        pos += BLOCK + (Py_ssize_t)((size + BLOCK - 1) / BLOCK * BLOCK);
    }
    if (pos != end || members == 0)
        goto other;
    return sample;
other:
    Py_XDECREF(sample);
    Py_XDECREF(field);
    Py_XDECREF(data);
    Py_RETURN_NONE;
error:
    Py_XDECREF(sample);
    Py_XDECREF(field);
    Py_XDECREF(data);
    return NULL;
}

/* Offset `item` of the index less `base`, into *out: 1 if it is an int within Py_ssize_t
 * and the difference one too, 0 if not (the caller returns None), -1 with an exception
 * set for an item that is not an int. */
static int relative(PyObject *item, Py_ssize_t base, Py_ssize_t *out)
{
    Py_ssize_t value = PyLong_AsSsize_t(item);
    if (value == -1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError))
            return -1;
        PyErr_Clear();
        return 0;
    }
    if ((base > 0 && value < PY_SSIZE_T_MIN + base) || (base < 0 && value > PY_SSIZE_T_MAX + base))
        return 0;
    *out = value - base;
    return 1;
}

/* Samples k of `keys`, each from offsets[k] to offsets[k + 1] (minus `base`) of buf. */
static PyObject *cut(const unsigned char *buf, Py_ssize_t len, Py_ssize_t base, PyObject *offsets, PyObject *keys,
                     PyObject *url, int verify)
{
    PyObject *offsets_fast = NULL, *keys_fast = NULL, *result = NULL;
    Py_ssize_t n, k;

    offsets_fast = PySequence_Fast(offsets, "offsets must be a sequence");
    keys_fast = offsets_fast == NULL ? NULL : PySequence_Fast(keys, "keys must be a sequence");
    if (keys_fast == NULL)
        goto done;
    n = PySequence_Fast_GET_SIZE(keys_fast);
    if (PySequence_Fast_GET_SIZE(offsets_fast) != n + 1) {
        PyErr_SetString(PyExc_ValueError, "offsets must hold one more item than keys");
        goto done;
    }
    result = PyList_New(n);
    if (result == NULL)
        goto done;
    for (k = 0; k < n; k++) {
        /* A list given here is the list itself, and any allocation below can run a
         * finalizer (the garbage collector) that changes it: its size is checked again
         * for every sample, and the items used are held, not borrowed. */
        PyObject *key, *start, *stop, *sample;
        Py_ssize_t a = 0, b = 0;
        int in_a, in_b;
        if (PySequence_Fast_GET_SIZE(keys_fast) != n || PySequence_Fast_GET_SIZE(offsets_fast) != n + 1) {
            PyErr_SetString(PyExc_RuntimeError, "keys or offsets changed size during the call");
            goto fail;
        }
        key = Py_NewRef(PySequence_Fast_GET_ITEM(keys_fast, k));
        start = Py_NewRef(PySequence_Fast_GET_ITEM(offsets_fast, k));
        stop = Py_NewRef(PySequence_Fast_GET_ITEM(offsets_fast, k + 1));
        in_a = relative(start, base, &a);
        in_b = in_a < 0 ? -1 : relative(stop, base, &b);
        Py_DECREF(start);
        Py_DECREF(stop);
        if (in_b < 0 || !PyUnicode_Check(key)) {
            if (in_b >= 0)
                PyErr_SetString(PyExc_TypeError, "keys must be str");
            Py_DECREF(key);
            goto fail;
        }
        if (!in_a || !in_b || a < 0 || b > len || a >= b) {
            Py_DECREF(key);
            Py_CLEAR(result);
            result = Py_NewRef(Py_None);
            goto done;
        }
        sample = cut_one(buf, a, b, key, url, verify);
        Py_DECREF(key);
        if (sample == NULL)
            goto fail;
        if (sample == Py_None) {
            Py_CLEAR(result);
            result = sample;
            goto done;
        }
        PyList_SET_ITEM(result, k, sample);
    }
    goto done;
fail:
    Py_CLEAR(result);
done:
    Py_XDECREF(offsets_fast);
    Py_XDECREF(keys_fast);
    return result;
}

/* -- the functions ---------------------------------------------------------------------- */

PyDoc_STRVAR(cut_samples_doc,
             "cut_samples(buf, base, offsets, keys, url) -> list[dict] | None\n\n"
             "The samples of plain tar stream `buf`, which begins at stream offset `base`: sample k\n"
             "spans offsets[k]..offsets[k + 1] and has key keys[k]. Header checksums are checked.\n"
             "None where any sample is not in the common layout (parse those in Python).");

static PyObject *cut_samples(PyObject *self, PyObject *args)
{
    Py_buffer buf;
    Py_ssize_t base;
    PyObject *offsets, *keys, *url, *result;
    if (!PyArg_ParseTuple(args, "y*nOOU", &buf, &base, &offsets, &keys, &url))
        return NULL;
    result = cut((const unsigned char *)buf.buf, buf.len, base, offsets, keys, url, 1);
    PyBuffer_Release(&buf);
    return result;
}

typedef struct {
    ZSTD_DCtx *dctx;
    unsigned char *scratch;
    size_t capacity;
    int busy; /* a call is using it: the GIL is dropped while it decompresses */
} Context;

static void context_free(PyObject *capsule)
{
    Context *ctx = PyCapsule_GetPointer(capsule, "shardstream._tarcut.Context");
    if (ctx == NULL)
        return;
    ZSTD_freeDCtx(ctx->dctx);
    free(ctx->scratch);
    free(ctx);
}

PyDoc_STRVAR(new_context_doc,
             "new_context() -> capsule\n\n"
             "A zstd decompression context and its output buffer, for one thread at a time.");

static PyObject *new_context(PyObject *self, PyObject *unused)
{
    Context *ctx = calloc(1, sizeof(Context));
    PyObject *capsule;
    if (ctx == NULL)
        return PyErr_NoMemory();
    ctx->dctx = ZSTD_createDCtx();
    if (ctx->dctx == NULL) {
        free(ctx);
        return PyErr_NoMemory();
    }
    capsule = PyCapsule_New(ctx, "shardstream._tarcut.Context", context_free);
    if (capsule == NULL) {
        ZSTD_freeDCtx(ctx->dctx);
        free(ctx);
    }
    return capsule;
}

PyDoc_STRVAR(frame_samples_doc,
             "frame_samples(context, frame, size, base, offsets, keys, url) -> list[dict] | None\n\n"
             "Decompress the zstd frame `frame`, which must hold exactly `size` bytes (its content\n"
             "checksum is checked; bytes after the first frame are ignored, as python-zstandard's\n"
             "decompress() ignores them), then cut samples out of it as cut_samples does, the frame\n"
             "beginning at stream offset `base` (tar header checksums are not checked: the frame's\n"
             "covers them). Raises FrameError for a frame zstd refuses, RuntimeError if `context`\n"
             "is in use by another call (another thread's).");

static PyObject *frame_samples(PyObject *self, PyObject *args)
{
    PyObject *capsule, *offsets, *keys, *url, *result = NULL;
    Py_buffer frame;
    Py_ssize_t size, base;
    Context *ctx;
    size_t got, frame_len;
    int released = 0;

    if (!PyArg_ParseTuple(args, "Oy*nnOOU", &capsule, &frame, &size, &base, &offsets, &keys, &url))
        return NULL;
    ctx = PyCapsule_GetPointer(capsule, "shardstream._tarcut.Context");
    if (ctx == NULL)
        goto done;
    if (size < 0) {
        PyErr_SetString(PyExc_ValueError, "size must be >= 0");
        goto done;
    }
    /* One call at a time: another thread (the GIL is dropped below) or a call made from
     * inside this one would decompress into, or free, the buffer this one is using. */
    if (ctx->busy) {
        PyErr_SetString(PyExc_RuntimeError, "this context is in use by another call (one context per thread)");
        goto done;
    }
    ctx->busy = 1;
    if ((size_t)size > ctx->capacity || ctx->scratch == NULL) {
        unsigned char *grown = malloc(size ? (size_t)size : 1);
        if (grown == NULL) {
            PyErr_NoMemory();
            goto unlock;
        }
        free(ctx->scratch);
        ctx->scratch = grown;
        ctx->capacity = (size_t)size;
    }
    Py_BEGIN_ALLOW_THREADS
    /* The first frame only, as python-zstandard's decompress() reads it: bytes after it
     * in the index's span (another frame, garbage) are ignored by the Python path too. */
    frame_len = ZSTD_findFrameCompressedSize(frame.buf, (size_t)frame.len);
    got = ZSTD_isError(frame_len) ? frame_len
                                  : ZSTD_decompressDCtx(ctx->dctx, ctx->scratch, (size_t)size, frame.buf, frame_len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&frame);
    released = 1;
    if (ZSTD_isError(got)) {
        PyErr_SetString(FrameError, ZSTD_getErrorName(got));
        goto unlock;
    }
    if (got != (size_t)size) {
        PyErr_Format(FrameError, "the frame holds %zu bytes, expected %zd", got, size);
        goto unlock;
    }
    result = cut(ctx->scratch, size, base, offsets, keys, url, 0);
unlock:
    if (ctx->capacity > KEEP_SCRATCH) { /* on every path: a failed huge frame's buffer too */
        free(ctx->scratch);
        ctx->scratch = NULL;
        ctx->capacity = 0;
    }
    ctx->busy = 0;
done:
    if (!released)
        PyBuffer_Release(&frame);
    return result;
}

static PyMethodDef methods[] = {
    {"cut_samples", cut_samples, METH_VARARGS, cut_samples_doc},
    {"frame_samples", frame_samples, METH_VARARGS, frame_samples_doc},
    {"new_context", new_context, METH_NOARGS, new_context_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_tarcut", "Cutting an indexed shard's samples out of tar bytes, and zstd frames.", -1,
    methods,
};

PyMODINIT_FUNC PyInit__tarcut(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    KEY = PyUnicode_InternFromString("__key__");
    URL = PyUnicode_InternFromString("__url__");
    FrameError = PyErr_NewException("shardstream._tarcut.FrameError", PyExc_ValueError, NULL);
    if (KEY == NULL || URL == NULL || FrameError == NULL || PyModule_AddObjectRef(m, "FrameError", FrameError) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
