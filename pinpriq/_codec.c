/* The codec's hot frames in C: runs of push (70), push with options (71) and pop (50) frames,
 * decoded for wire.FrameDecoder.
 *
 * wire.py stays the codec: it owns every layout, every other frame and every error, and it is
 * what the client and a build without a compiler run. This file only reads the three frames a
 * busy server sees most, with native reads of the header and one copy per field, and builds
 * the same frame objects wire.py builds (its Push, DelayedPush and Pop named tuples, filled in
 * place: no argument tuple, no tuple.__new__). It knows no socket and no clock.
 *
 * Decoder(push, delayed_push, pop) holds what wire.FrameDecoder's Python path holds between
 * frames: the last push's queue name (so that a connection's frames share one name object,
 * whose hash the store computes once) and the last pop frame (one frame serves a pipelined run
 * of pops), kept apart so that a connection pushing to one queue and popping another (a
 * worker; a client's pop or sync after each push) shares both.
 * decode(data, pos, frames) appends the frames from ``pos`` on and returns where it stopped:
 * at the end of ``data``; at an incomplete hot frame (``need`` then says how many bytes that
 * frame needs, counted from its start, as wire.py counts); or at a frame it leaves to wire.py
 * (any other opcode, or a 71 whose delay makes it malformed: wire.py raises the error). So the
 * frames, the errors and their offsets are wire.py's by construction; tests/test_wire.py
 * checks that against the Python path on random streams.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

/* wire.py's constants (its asserts check the opcodes and sizes against the protocol). */
#define OP_PUSH 0x70
#define OP_PUSH_OPTIONS 0x71
#define OP_POP 0x50
#define PUSH_HEAD 10    /* opcode, queue_len u16, ttl_ms u16, prio u8, key_len u16, payload_len u16 */
#define OPTIONS_HEAD 16 /* opcode, queue_len u16, ttl_ms u32, delay_ms u32, prio u8, two u16 */
#define NAME_HEAD 3     /* opcode, queue_len u16 */
#define SHARED_NAME_MAX 256
#define MAX_DELAY_MS 2592000000u

typedef struct {
    PyObject_HEAD
    PyTypeObject *push_type, *delayed_type, *pop_type;
    PyObject *queue; /* bytes: the last push's queue name, shared between frames */
    PyObject *pop;   /* the last pop frame, or NULL */
    Py_ssize_t need; /* bytes the incomplete frame decode stopped at needs; 0 if none */
} DecoderObject;

static inline uint32_t u16_at(const unsigned char *b) { return (uint32_t)b[0] << 8 | b[1]; }

static inline uint32_t u32_at(const unsigned char *b) {
    return (uint32_t)b[0] << 24 | (uint32_t)b[1] << 16 | (uint32_t)b[2] << 8 | b[3];
}

/* A frame of ``type`` (a tuple subclass) with ``n`` items, stolen from ``items``; NULL if any
 * of them is NULL (an allocation failed: the error is set) or allocation fails. */
static PyObject *frame_new(PyTypeObject *type, Py_ssize_t n, PyObject **items) {
    PyObject *frame = NULL;
    for (Py_ssize_t i = 0; i < n; i++)
        if (items[i] == NULL)
            goto fail;
    frame = type->tp_alloc(type, n);
    if (frame == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++)
        PyTuple_SET_ITEM(frame, i, items[i]);
    return frame;
fail:
    for (Py_ssize_t i = 0; i < n; i++)
        Py_XDECREF(items[i]);
    return NULL;
}

/* Whether ``name`` (bytes) is the queue name at ``at``. */
static inline int names(PyObject *name, const unsigned char *at, Py_ssize_t len) {
    return PyBytes_GET_SIZE(name) == len && memcmp(PyBytes_AS_STRING(name), at, len) == 0;
}

/* The queue name at ``at`` as a new reference: the shared object if it is that name, else a
 * new one, which becomes the shared one if ``share`` and it is short enough (wire.py's rule). */
static PyObject *queue_name(DecoderObject *self, const unsigned char *at, Py_ssize_t len,
                            int share) {
    if (names(self->queue, at, len)) {
        Py_INCREF(self->queue);
        return self->queue;
    }
    PyObject *name = PyBytes_FromStringAndSize((const char *)at, len);
    if (name != NULL && share && len <= SHARED_NAME_MAX) {
        Py_INCREF(name);
        Py_SETREF(self->queue, name);
    }
    return name;
}

/* A push (70) or push with options (71) at ``b``, complete; ``head`` is its header's size. */
static PyObject *push_frame(DecoderObject *self, const unsigned char *b, Py_ssize_t head,
                            uint32_t ttl_ms, uint32_t delay_ms, uint8_t prio, uint32_t klen,
                            uint32_t plen, uint32_t qlen) {
    const unsigned char *key = b + head;
    const unsigned char *payload = key + klen;
    PyObject *items[6];
    items[0] = queue_name(self, payload + plen, qlen, 1);
    items[1] = PyBytes_FromStringAndSize((const char *)key, klen);
    items[2] = PyBytes_FromStringAndSize((const char *)payload, plen);
    items[3] = PyLong_FromUnsignedLong(ttl_ms);
    items[4] = PyLong_FromUnsignedLong(prio);
    if (!delay_ms) /* decision 21: a 71 with no delay is a push */
        return frame_new(self->push_type, 5, items);
    items[5] = PyLong_FromUnsignedLong(delay_ms);
    return frame_new(self->delayed_type, 6, items);
}

/* A pop frame naming the queue at ``at``, as a new reference: the last one if it names that
 * queue (a pipelining consumer sends the same pop many times), else a new one, which becomes
 * the last one if its name is short enough; its name is the push's shared one if it is that. */
static PyObject *pop_frame(DecoderObject *self, const unsigned char *at, Py_ssize_t len) {
    if (self->pop != NULL && names(PyTuple_GET_ITEM(self->pop, 0), at, len)) {
        Py_INCREF(self->pop);
        return self->pop;
    }
    PyObject *items[1];
    items[0] = queue_name(self, at, len, 0);
    PyObject *frame = frame_new(self->pop_type, 1, items);
    if (frame != NULL && len <= SHARED_NAME_MAX) {
        Py_INCREF(frame);
        Py_XSETREF(self->pop, frame);
    }
    return frame;
}

/* decode(data, pos, frames) -> the offset it stopped at (see the opening comment). */
static PyObject *Decoder_decode(DecoderObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyList_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "decode(data, pos, frames: list)");
        return NULL;
    }
    Py_ssize_t pos = PyLong_AsSsize_t(args[1]);
    if (pos == -1 && PyErr_Occurred())
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const unsigned char *data = view.buf;
    Py_ssize_t end = view.len;
    PyObject *frames = args[2];
    int failed = 0;
    if (self->queue == NULL) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_TypeError, "Decoder.__init__ was not called");
        return NULL;
    }
    self->need = 0;
    if (pos < 0)
        pos = end; /* nothing to do: wire.py never asks for this */
    while (pos < end) {
        const unsigned char *b = data + pos;
        PyObject *frame;
        Py_ssize_t stop;
        if (*b == OP_PUSH || *b == OP_PUSH_OPTIONS) {
            Py_ssize_t head = *b == OP_PUSH ? PUSH_HEAD : OPTIONS_HEAD;
            if (end - pos < head) {
                self->need = head;
                break;
            }
            uint32_t ttl_ms, delay_ms, klen, plen;
            uint8_t prio;
            if (*b == OP_PUSH) {
                ttl_ms = u16_at(b + 3);
                delay_ms = 0;
                prio = b[5];
                klen = u16_at(b + 6);
                plen = u16_at(b + 8);
            } else {
                ttl_ms = u32_at(b + 3);
                delay_ms = u32_at(b + 7);
                prio = b[11];
                klen = u16_at(b + 12);
                plen = u16_at(b + 14);
                if (delay_ms > MAX_DELAY_MS)
                    break; /* malformed: wire.py says so */
            }
            uint32_t qlen = u16_at(b + 1);
            stop = pos + head + klen + plen + qlen;
            if (stop > end) {
                self->need = stop - pos;
                break;
            }
            frame = push_frame(self, b, head, ttl_ms, delay_ms, prio, klen, plen, qlen);
        } else if (*b == OP_POP) {
            if (end - pos < NAME_HEAD) {
                self->need = NAME_HEAD;
                break;
            }
            stop = pos + NAME_HEAD + u16_at(b + 1);
            if (stop > end) {
                self->need = stop - pos;
                break;
            }
            frame = pop_frame(self, b + NAME_HEAD, stop - pos - NAME_HEAD);
        } else {
            break; /* wire.py's */
        }
        if (frame == NULL || PyList_Append(frames, frame) < 0) {
            Py_XDECREF(frame);
            failed = 1;
            break;
        }
        Py_DECREF(frame);
        pos = stop;
    }
    PyBuffer_Release(&view);
    return failed ? NULL : PyLong_FromSsize_t(pos);
}

static int Decoder_init(DecoderObject *self, PyObject *args, PyObject *kwargs) {
    PyTypeObject *push, *delayed, *pop;
    if (!PyArg_ParseTuple(args, "O!O!O!:Decoder", &PyType_Type, &push, &PyType_Type, &delayed,
                          &PyType_Type, &pop))
        return -1;
    PyTypeObject *types[3] = {push, delayed, pop};
    for (int i = 0; i < 3; i++) {
        if (!PyType_IsSubtype(types[i], &PyTuple_Type)) {
            PyErr_SetString(PyExc_TypeError, "frame types must be tuple subclasses");
            return -1;
        }
    }
    Py_INCREF(push);
    Py_INCREF(delayed);
    Py_INCREF(pop);
    Py_XSETREF(self->push_type, push);
    Py_XSETREF(self->delayed_type, delayed);
    Py_XSETREF(self->pop_type, pop);
    Py_XSETREF(self->queue, PyBytes_FromStringAndSize(NULL, 0));
    Py_CLEAR(self->pop);
    self->need = 0;
    return self->queue == NULL ? -1 : 0;
}

static int Decoder_traverse(DecoderObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->push_type);
    Py_VISIT(self->delayed_type);
    Py_VISIT(self->pop_type);
    Py_VISIT(self->pop);
    return 0;
}

static int Decoder_clear(DecoderObject *self) {
    Py_CLEAR(self->push_type);
    Py_CLEAR(self->delayed_type);
    Py_CLEAR(self->pop_type);
    Py_CLEAR(self->queue);
    Py_CLEAR(self->pop);
    return 0;
}

static void Decoder_dealloc(DecoderObject *self) {
    PyObject_GC_UnTrack(self);
    Decoder_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Decoder_methods[] = {
    {"decode", (PyCFunction)(void (*)(void))Decoder_decode, METH_FASTCALL,
     "decode(data, pos, frames) -> offset: append the push and pop frames from pos on"},
    {NULL},
};

static PyMemberDef Decoder_members[] = {
    {"need", T_PYSSIZET, offsetof(DecoderObject, need), READONLY,
     "bytes the incomplete frame decode stopped at needs, from its start; 0 if none"},
    {NULL},
};

static PyTypeObject DecoderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "pinpriq._codec.Decoder",
    .tp_basicsize = sizeof(DecoderObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Decoder(push, delayed_push, pop): wire.FrameDecoder's push and pop frames, in C",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Decoder_init,
    .tp_traverse = (traverseproc)Decoder_traverse,
    .tp_clear = (inquiry)Decoder_clear,
    .tp_dealloc = (destructor)Decoder_dealloc,
    .tp_methods = Decoder_methods,
    .tp_members = Decoder_members,
};

static struct PyModuleDef codec_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "pinpriq._codec",
    .m_doc = "wire.FrameDecoder's hot frames (push, push with options, pop) in C",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__codec(void) {
    if (PyType_Ready(&DecoderType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&codec_module);
    if (module == NULL)
        return NULL;
    Py_INCREF(&DecoderType);
    if (PyModule_AddObject(module, "Decoder", (PyObject *)&DecoderType) < 0) {
        Py_DECREF(&DecoderType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
