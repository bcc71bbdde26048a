/* agent_sandbox.guards._fastimport: the user namespace's `__import__`, with one fast path in C.
 *
 * CPython 3.11's IMPORT_NAME takes its own fast path only when `__import__` is the built-in
 * one; any other callable is called with five positional arguments (name, globals, locals or
 * None, fromlist or None, level). The import guard's `__import__` is a Python function, so
 * every `import json` of user code paid for a Python frame, even for a module the guard had
 * already allowed and that was already loaded.
 *
 * FastImport(ok, modules, slow) answers such a call itself when all of these hold:
 *   - positional arguments only, 1 to 5 of them;
 *   - `name` is an exact str; `fromlist` is absent, None, or an empty exact tuple or list;
 *     `level` is absent or an exact int equal to 0;
 *   - `name` is in `ok` (an exact set: the top-level names the guard allowed and imported)
 *     and `modules` (sys.modules) maps it to something other than None.
 * It then returns `modules[name]`. Every other call, a miss included, goes to
 * `slow(*args, **kwargs)` unchanged, so the Python guard stays the only judge.
 *
 * The object hides what it holds from user code: no attributes, no `__dict__`, no
 * `__init__` that could re-point it, not subclassable, not picklable (object's default
 * reduce refuses a C object with state). `gc.get_referents` would list the three objects;
 * the guards refuse that call to user code.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h> /* offsetof */

typedef struct {
    PyObject_HEAD
    PyObject *ok;      /* set of str: names the guard allowed and imported */
    PyObject *modules; /* dict: sys.modules */
    PyObject *slow;    /* callable: the Python guard's `__import__` */
    vectorcallfunc vectorcall;
} FastImport;

/* 1 when the arguments ask for a plain `import name` (no fromlist, level 0), 0 when not,
 * -1 with an exception set on error. Only exact built-in types are looked at, so no Python
 * code runs here. */
static int
plain_import(PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 5 || !PyUnicode_CheckExact(args[0])) {
        return 0;
    }
    if (nargs >= 4) {
        PyObject *fromlist = args[3];
        if (fromlist != Py_None
            && !(PyTuple_CheckExact(fromlist) && PyTuple_GET_SIZE(fromlist) == 0)
            && !(PyList_CheckExact(fromlist) && PyList_GET_SIZE(fromlist) == 0)) {
            return 0;
        }
    }
    if (nargs == 5) {
        int overflow = 0;
        if (!PyLong_CheckExact(args[4])) {
            return 0;
        }
        long level = PyLong_AsLongAndOverflow(args[4], &overflow);
        if (level == -1 && PyErr_Occurred()) {
            return -1;
        }
        if (level != 0 || overflow) {
            return 0;
        }
    }
    return 1;
}

static PyObject *
fastimport_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                      PyObject *kwnames)
{
    FastImport *self = (FastImport *)callable;
    if (self->ok == NULL || self->modules == NULL || self->slow == NULL) {
        /* only after the garbage collector cleared it (tp_clear) */
        PyErr_SetString(PyExc_RuntimeError, "the fast import was cleared");
        return NULL;
    }
    if (kwnames == NULL || PyTuple_GET_SIZE(kwnames) == 0) {
        int plain = plain_import(args, PyVectorcall_NARGS(nargsf));
        if (plain < 0) {
            return NULL;
        }
        if (plain) {
            int known = PySet_Contains(self->ok, args[0]);
            if (known < 0) {
                return NULL;
            }
            if (known) {
                /* borrowed; taken as a new reference before any other code can run */
                PyObject *module = PyDict_GetItemWithError(self->modules, args[0]);
                if (module != NULL && module != Py_None) {
                    return Py_NewRef(module);
                }
                if (module == NULL && PyErr_Occurred()) {
                    return NULL;
                }
            }
        }
    }
    /* The slow path: the arguments exactly as received. Hold `slow` for the call. */
    PyObject *slow = Py_NewRef(self->slow);
    PyObject *result = PyObject_Vectorcall(slow, args, nargsf, kwnames);
    Py_DECREF(slow);
    return result;
}

static PyObject *
fastimport_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"", "", "", NULL}; /* positional only */
    PyObject *ok, *modules, *slow;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO:FastImport", kwlist, &ok, &modules,
                                     &slow)) {
        return NULL;
    }
    if (!PySet_CheckExact(ok) || !PyDict_Check(modules) || !PyCallable_Check(slow)) {
        PyErr_SetString(PyExc_TypeError,
                        "FastImport(ok, modules, slow) takes a set, a dict and a callable");
        return NULL;
    }
    FastImport *self = (FastImport *)type->tp_alloc(type, 0); /* zeroed, tracked by the GC */
    if (self == NULL) {
        return NULL;
    }
    self->ok = Py_NewRef(ok);
    self->modules = Py_NewRef(modules);
    self->slow = Py_NewRef(slow);
    self->vectorcall = fastimport_vectorcall;
    return (PyObject *)self;
}

static int
fastimport_traverse(FastImport *self, visitproc visit, void *arg)
{
    Py_VISIT(self->ok);
    Py_VISIT(self->modules);
    Py_VISIT(self->slow);
    return 0;
}

static int
fastimport_clear(FastImport *self)
{
    Py_CLEAR(self->ok);
    Py_CLEAR(self->modules);
    Py_CLEAR(self->slow);
    return 0;
}

static void
fastimport_dealloc(FastImport *self)
{
    PyObject_GC_UnTrack(self);
    fastimport_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
fastimport_repr(PyObject *self)
{
    return PyUnicode_FromString("<agent_sandbox import guard: __import__>");
}

/* A static type: immutable, and without Py_TPFLAGS_BASETYPE it cannot be subclassed. No
 * tp_init (calling __init__ again cannot re-point an instance), no members, no getset. */
static PyTypeObject FastImport_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "agent_sandbox.guards._fastimport.FastImport",
    .tp_doc = PyDoc_STR("__import__ for user code: serves an allowed, loaded module itself "
                        "and passes every other call to the import guard."),
    .tp_basicsize = sizeof(FastImport),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL
                | Py_TPFLAGS_IMMUTABLETYPE,
    .tp_vectorcall_offset = offsetof(FastImport, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_new = fastimport_new,
    .tp_traverse = (traverseproc)fastimport_traverse,
    .tp_clear = (inquiry)fastimport_clear,
    .tp_dealloc = (destructor)fastimport_dealloc,
    .tp_repr = fastimport_repr,
};

static struct PyModuleDef fastimport_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "agent_sandbox.guards._fastimport",
    .m_doc = PyDoc_STR("The import guard's fast path for already-allowed, loaded modules."),
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__fastimport(void)
{
    if (PyType_Ready(&FastImport_Type) < 0) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&fastimport_module);
    if (module == NULL) {
        return NULL;
    }
    PyObject *all = Py_BuildValue("[s]", "FastImport");
    if (PyModule_AddType(module, &FastImport_Type) < 0 || all == NULL
        || PyModule_AddObjectRef(module, "__all__", all) < 0) {
        Py_XDECREF(all);
        Py_DECREF(module);
        return NULL;
    }
    Py_DECREF(all);
    return module;
}
