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
#include <stdint.h>

typedef struct {
    PyObject_HEAD
    PyObject *ok;      /* set of str: names the guard allowed and imported */
    PyObject *modules; /* dict: sys.modules */
    PyObject *slow;    /* callable: the Python guard's `__import__` */
    PyObject *views;   /* dict or NULL: name -> the ModuleView user code gets for it */
    vectorcallfunc vectorcall;
} FastImport;

static PyTypeObject ModuleView_Type;
static PyObject *view_real(PyObject *view);

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
                if (module != NULL && module != Py_None && self->views == NULL) {
                    return Py_NewRef(module);
                }
                if (module != NULL && module != Py_None) {
                    /* With views, user code gets the module's view, and only the view made
                     * for this very module object (a module imported again gets a new one
                     * from the slow path). */
                    PyObject *view = PyDict_GetItemWithError(self->views, args[0]);
                    if (view != NULL
                        && (view == module
                            || (Py_IS_TYPE(view, &ModuleView_Type)
                                && view_real(view) == module))) {
                        /* the module itself when it needs no view (the guard decided) */
                        return Py_NewRef(view);
                    }
                    if (view == NULL && PyErr_Occurred()) {
                        return NULL;
                    }
                    module = NULL;
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
    static char *kwlist[] = {"", "", "", "", NULL}; /* positional only */
    PyObject *ok, *modules, *slow, *views = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO|O:FastImport", kwlist, &ok, &modules,
                                     &slow, &views)) {
        return NULL;
    }
    if (views == Py_None) {
        views = NULL;
    }
    if (!PySet_CheckExact(ok) || !PyDict_Check(modules) || !PyCallable_Check(slow)
        || (views != NULL && !PyDict_CheckExact(views))) {
        PyErr_SetString(PyExc_TypeError, "FastImport(ok, modules, slow[, views]) takes a set, "
                                         "a dict, a callable and optionally a dict");
        return NULL;
    }
    FastImport *self = (FastImport *)type->tp_alloc(type, 0); /* zeroed, tracked by the GC */
    if (self == NULL) {
        return NULL;
    }
    self->ok = Py_NewRef(ok);
    self->modules = Py_NewRef(modules);
    self->slow = Py_NewRef(slow);
    self->views = Py_XNewRef(views);
    self->vectorcall = fastimport_vectorcall;
    return (PyObject *)self;
}

static int
fastimport_traverse(FastImport *self, visitproc visit, void *arg)
{
    Py_VISIT(self->ok);
    Py_VISIT(self->modules);
    Py_VISIT(self->slow);
    Py_VISIT(self->views);
    return 0;
}

static int
fastimport_clear(FastImport *self)
{
    Py_CLEAR(self->ok);
    Py_CLEAR(self->modules);
    Py_CLEAR(self->slow);
    Py_CLEAR(self->views);
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

/* ---- ModuleView: an allowed module as user code sees it --------------------------------
 *
 * ModuleView(real, hook) is a module object (a subclass of the module type, so
 * `isinstance(view, types.ModuleType)` holds) whose own namespace stays empty: every
 * attribute read goes to `real`, and every write or delete goes to `real` too. A value read
 * that is itself a module, and the names `__dict__`, `__builtins__` and `modules`, go
 * through `hook(real, name, value)`, whose answer is what the reader gets: the import guard
 * judges there a module reached as an attribute like an import of that module (a view of
 * it, or a refusal). A module's answer is remembered per view while the attribute still
 * holds the same object, so `np.linalg.norm` asks Python once.
 *
 * What it does NOT hide: `ModuleType.__getattribute__(view, name)` reads the view's own,
 * empty namespace, so it finds nothing; `gc.get_referents(view)` lists `real` (the guards
 * refuse that call to user code); anything holding `real` directly (a function's
 * `__globals__`) is outside it.
 */

typedef struct {
    PyObject *dict;  /* the module's namespace (fixed for the module's life) */
    PyObject *real;  /* the module */
    PyObject *hook;  /* callable(real, name, value) -> what the reader gets */
    PyObject *cache; /* dict: name -> (value, answer), for module values */
} ViewExtra;

static Py_ssize_t view_offset; /* where ViewExtra starts: after the module object */

#define VIEW_EXTRA(o) ((ViewExtra *)((char *)(o) + view_offset))

static PyObject *
view_real(PyObject *view)
{
    return VIEW_EXTRA(view)->real;
}

/* 1 when `name` is one of the names the hook sees whatever their value. */
static int
special_name(PyObject *name)
{
    if (!PyUnicode_CheckExact(name)) {
        return 0;
    }
    Py_ssize_t n = PyUnicode_GET_LENGTH(name);
    if (n == 7) {
        return PyUnicode_CompareWithASCIIString(name, "modules") == 0;
    }
    if (n == 8) {
        return PyUnicode_CompareWithASCIIString(name, "__dict__") == 0;
    }
    if (n == 12) {
        return PyUnicode_CompareWithASCIIString(name, "__builtins__") == 0;
    }
    return 0;
}

static PyObject *
view_getattro(PyObject *self, PyObject *name)
{
    ViewExtra *x = VIEW_EXTRA(self);
    if (x->real == NULL || x->hook == NULL || x->cache == NULL || x->dict == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the module view was cleared");
        return NULL;
    }
    /* The common case first: a plain name found in the module's namespace. Only dunder
     * names can be data descriptors of the module type (`__dict__`, `__class__`), which
     * the generic lookup below would prefer over the namespace. */
    PyObject *value = NULL;
    if (PyUnicode_CheckExact(name) && PyUnicode_GET_LENGTH(name) > 0
        && PyUnicode_READ_CHAR(name, 0) != '_') {
        value = PyDict_GetItemWithError(x->dict, name); /* borrowed */
        if (value == NULL && PyErr_Occurred()) {
            return NULL;
        }
        if (value != NULL && !PyModule_Check(value) && !special_name(name)) {
            return Py_NewRef(value);
        }
        Py_XINCREF(value);
    }
    if (value == NULL) {
        value = PyObject_GetAttr(x->real, name);
        if (value == NULL) {
            return NULL;
        }
    }
    int is_module = PyModule_Check(value);
    if (is_module && Py_IS_TYPE(value, &ModuleView_Type)) {
        return value; /* already a view: judged when it was made */
    }
    if (!is_module && !special_name(name)) {
        return value;
    }
    if (is_module) {
        PyObject *hit = PyDict_GetItemWithError(x->cache, name); /* borrowed */
        if (hit != NULL && PyTuple_CheckExact(hit) && PyTuple_GET_SIZE(hit) == 2
            && PyTuple_GET_ITEM(hit, 0) == value) {
            PyObject *answer = Py_NewRef(PyTuple_GET_ITEM(hit, 1));
            Py_DECREF(value);
            return answer;
        }
        if (hit == NULL && PyErr_Occurred()) {
            Py_DECREF(value);
            return NULL;
        }
    }
    PyObject *hook = Py_NewRef(x->hook);
    PyObject *answer = PyObject_CallFunctionObjArgs(hook, x->real, name, value, NULL);
    Py_DECREF(hook);
    if (answer != NULL && is_module && Py_IS_TYPE(answer, &ModuleView_Type)) {
        /* Only a view is remembered: a refusal is judged (and recorded) every time, and a
         * module handed out unwrapped (guards disarmed) must not be served later. */
        PyObject *pair = PyTuple_Pack(2, value, answer);
        if (pair == NULL || PyDict_SetItem(x->cache, name, pair) < 0) {
            Py_XDECREF(pair);
            Py_DECREF(value);
            Py_DECREF(answer);
            return NULL;
        }
        Py_DECREF(pair);
    }
    Py_DECREF(value);
    return answer;
}

static int
view_setattro(PyObject *self, PyObject *name, PyObject *value)
{
    ViewExtra *x = VIEW_EXTRA(self);
    if (x->real == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the module view was cleared");
        return -1;
    }
    return PyObject_SetAttr(x->real, name, value); /* value NULL: delete */
}

static PyObject *
view_repr(PyObject *self)
{
    ViewExtra *x = VIEW_EXTRA(self);
    if (x->real == NULL) {
        return PyUnicode_FromString("<module view (cleared)>");
    }
    return PyObject_Repr(x->real);
}

static PyObject *
view_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"", "", NULL};
    PyObject *real, *hook;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO:ModuleView", kwlist, &real, &hook)) {
        return NULL;
    }
    if (!PyModule_Check(real) || Py_IS_TYPE(real, &ModuleView_Type) || !PyCallable_Check(hook)) {
        PyErr_SetString(PyExc_TypeError, "ModuleView(real, hook) takes a module and a callable");
        return NULL;
    }
    PyObject *empty = PyTuple_New(0);
    if (empty == NULL) {
        return NULL;
    }
    /* The module type's own constructor: an empty namespace, tracked by the collector. */
    PyObject *self = PyModule_Type.tp_new(type, empty, NULL);
    Py_DECREF(empty);
    if (self == NULL) {
        return NULL;
    }
    ViewExtra *x = VIEW_EXTRA(self);
    x->cache = PyDict_New();
    if (x->cache == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    PyObject *dict = PyModule_GetDict(real); /* borrowed; never NULL for a module */
    if (dict == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    x->dict = Py_NewRef(dict);
    x->real = Py_NewRef(real);
    x->hook = Py_NewRef(hook);
    return self;
}

/* The module type's `__init__` would fill the view's own namespace: nothing to do here. */
static int
view_init(PyObject *self, PyObject *args, PyObject *kwargs)
{
    return 0;
}

static int
view_traverse(PyObject *self, visitproc visit, void *arg)
{
    ViewExtra *x = VIEW_EXTRA(self);
    Py_VISIT(x->dict);
    Py_VISIT(x->real);
    Py_VISIT(x->hook);
    Py_VISIT(x->cache);
    return PyModule_Type.tp_traverse(self, visit, arg);
}

static int
view_clear(PyObject *self)
{
    ViewExtra *x = VIEW_EXTRA(self);
    Py_CLEAR(x->dict);
    Py_CLEAR(x->real);
    Py_CLEAR(x->hook);
    Py_CLEAR(x->cache);
    return PyModule_Type.tp_clear(self);
}

static void
view_dealloc(PyObject *self)
{
    PyObject_GC_UnTrack(self);
    ViewExtra *x = VIEW_EXTRA(self);
    Py_CLEAR(x->dict);
    Py_CLEAR(x->real);
    Py_CLEAR(x->hook);
    Py_CLEAR(x->cache);
    PyModule_Type.tp_dealloc(self); /* frees the namespace and the object */
}

/* Not subclassable, immutable; `__class__` cannot be assigned to or from it (the module
 * type allows that only between module types of the same layout, and this one is larger). */
static PyTypeObject ModuleView_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "agent_sandbox.guards._fastimport.ModuleView",
    .tp_doc = PyDoc_STR("A module as user code sees it: reads and writes go to the module; "
                        "a module reached through it is judged like an import."),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .tp_getattro = view_getattro,
    .tp_setattro = view_setattro,
    .tp_repr = view_repr,
    .tp_new = view_new,
    .tp_init = view_init,
    .tp_traverse = view_traverse,
    .tp_clear = view_clear,
    .tp_dealloc = view_dealloc,
};

/* ---- The arming state, and the block the host reads ------------------------------------
 *
 * The guards enforce while `state.armed` is true. The flag lives here, in C, not in a
 * Python object: user code that reaches `state` can still write it, but every write
 * (arming or disarming, changed or not) adds one to `transitions`, which only this file
 * can change. A call of user code is exactly one arming and one disarming, so the host,
 * which reads the block below from the worker's memory (`/proc/<pid>/mem`, at the address
 * the worker reported in its handshake, before any user code ran), sees any other write:
 * a flag cleared and set back within the call included, whatever the worker's own Python
 * tamper check says. The other settings (`learn`, `policy_name`, `trusted_roots`,
 * `user_threads`) can be set until `seal()`; a write after it is refused and marks the
 * block `tampered` for the host as well.
 *
 * What it does NOT hold against: native code in the worker (ctypes, a C extension) can
 * rewrite this block like any other memory of its own process. The kernel boundary is
 * what holds then.
 */

#define BLOCK_HEAD 0x314d52415842534aULL /* "JSBXARM1", little-endian */
#define BLOCK_TAIL 0x444e454d52415842ULL /* "BXARMEND" */

typedef struct {
    uint64_t head;
    uint64_t transitions; /* every write of `armed` */
    uint64_t armed;       /* 0 or 1 */
    uint64_t tampered;    /* bit 0: a sealed setting was written; bit 1: the flag was
                           * found clear when run_armed's call returned */
    uint64_t tail;
} ArmBlock;

static volatile ArmBlock arm_block = {BLOCK_HEAD, 0, 0, 0, BLOCK_TAIL};

typedef struct {
    PyObject_HEAD
    PyObject *learn;
    PyObject *policy_name;
    PyObject *trusted_roots;
    PyObject *user_threads;
    int sealed;
} ArmState;

static PyObject *
state_get_armed(PyObject *self, void *closure)
{
    return PyBool_FromLong(arm_block.armed != 0);
}

static int
state_set_armed(PyObject *self, PyObject *value, void *closure)
{
    if (value == NULL) {
        arm_block.transitions += 1;
        PyErr_SetString(PyExc_TypeError, "the armed flag cannot be deleted");
        return -1;
    }
    int truth = PyObject_IsTrue(value);
    if (truth < 0) {
        return -1;
    }
    arm_block.transitions += 1;
    arm_block.armed = (uint64_t)truth;
    return 0;
}

static PyObject **
state_slot(ArmState *self, void *closure)
{
    switch ((intptr_t)closure) {
    case 0: return &self->learn;
    case 1: return &self->policy_name;
    case 2: return &self->trusted_roots;
    default: return &self->user_threads;
    }
}

static PyObject *
state_get(PyObject *self, void *closure)
{
    PyObject *value = *state_slot((ArmState *)self, closure);
    return Py_NewRef(value != NULL ? value : Py_None);
}

static int
state_set(PyObject *self, PyObject *value, void *closure)
{
    ArmState *st = (ArmState *)self;
    if (st->sealed) {
        arm_block.tampered |= 1;
        PyErr_SetString(PyExc_AttributeError,
                        "the guards' settings are sealed for the life of this worker");
        return -1;
    }
    if (value == NULL) {
        PyErr_SetString(PyExc_TypeError, "a guard setting cannot be deleted");
        return -1;
    }
    PyObject **slot = state_slot(st, closure);
    Py_XSETREF(*slot, Py_NewRef(value));
    return 0;
}

static PyObject *
state_seal(PyObject *self, PyObject *unused)
{
    ((ArmState *)self)->sealed = 1;
    Py_RETURN_NONE;
}

/* run_armed(fn, *args): arm, call fn(*args), disarm, in this C frame. Code that runs
 * inside `fn` cannot keep the final disarming from happening or from being counted, so a
 * flag it cleared itself shows as a third write. A flag found clear at the end is marked
 * in the block too (bit 1). */
static PyObject *
state_run_armed(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || !PyCallable_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "run_armed(fn, *args) takes a callable");
        return NULL;
    }
    PyObject *fn = Py_NewRef(args[0]);
    arm_block.transitions += 1;
    arm_block.armed = 1;
    PyObject *result = PyObject_Vectorcall(fn, args + 1, (size_t)(nargs - 1), NULL);
    if (!arm_block.armed) {
        arm_block.tampered |= 2;
    }
    arm_block.transitions += 1;
    arm_block.armed = 0;
    Py_DECREF(fn);
    return result;
}

static PyObject *
state_get_sealed(PyObject *self, void *closure)
{
    return PyBool_FromLong(((ArmState *)self)->sealed);
}

static PyGetSetDef state_getset[] = {
    {"armed", state_get_armed, state_set_armed,
     PyDoc_STR("whether the guards enforce (every write is counted)"), NULL},
    {"learn", state_get, state_set, PyDoc_STR("learning mode"), (void *)0},
    {"policy_name", state_get, state_set, PyDoc_STR("the policy's name"), (void *)1},
    {"trusted_roots", state_get, state_set, PyDoc_STR("folders whose code is not user code"),
     (void *)2},
    {"user_threads", state_get, state_set, PyDoc_STR("threads that stay armed"), (void *)3},
    {"sealed", state_get_sealed, NULL, PyDoc_STR("whether the settings are sealed"), NULL},
    {NULL},
};

static PyMethodDef state_methods[] = {
    {"run_armed", (PyCFunction)(void (*)(void))state_run_armed, METH_FASTCALL,
     PyDoc_STR("Arm, call fn(*args), disarm: two counted writes around the call.")},
    {"seal", state_seal, METH_NOARGS,
     PyDoc_STR("Refuse (and report to the host) every later write of a setting.")},
    {NULL},
};

static int
state_traverse(ArmState *self, visitproc visit, void *arg)
{
    Py_VISIT(self->learn);
    Py_VISIT(self->policy_name);
    Py_VISIT(self->trusted_roots);
    Py_VISIT(self->user_threads);
    return 0;
}

/* The one instance lives as long as the process: it is never cleared or freed. */
static PyTypeObject ArmState_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "agent_sandbox.guards._fastimport.ArmState",
    .tp_doc = PyDoc_STR("The guards' arming state (one per process)."),
    .tp_basicsize = sizeof(ArmState),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .tp_getset = state_getset,
    .tp_methods = state_methods,
    .tp_traverse = (traverseproc)state_traverse,
};

static PyObject *the_state;

static PyObject *
block_info(PyObject *module, PyObject *unused)
{
    return Py_BuildValue("{s:N,s:n,s:K,s:K}", "address", PyLong_FromVoidPtr((void *)&arm_block),
                         "size", (Py_ssize_t)sizeof(ArmBlock), "head",
                         (unsigned long long)BLOCK_HEAD, "tail", (unsigned long long)BLOCK_TAIL);
}

static PyObject *
block_read(PyObject *module, PyObject *unused)
{
    return Py_BuildValue("(KKK)", (unsigned long long)arm_block.transitions,
                         (unsigned long long)arm_block.armed,
                         (unsigned long long)arm_block.tampered);
}

static PyMethodDef module_methods[] = {
    {"block_info", block_info, METH_NOARGS,
     PyDoc_STR("Where the arming block is in this process's memory, for the host.")},
    {"block_read", block_read, METH_NOARGS,
     PyDoc_STR("(transitions, armed, tampered) as this process sees them.")},
    {NULL},
};

static struct PyModuleDef fastimport_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "agent_sandbox.guards._fastimport",
    .m_doc = PyDoc_STR("The import guard's fast path for already-allowed, loaded modules."),
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC
PyInit__fastimport(void)
{
    if (PyType_Ready(&FastImport_Type) < 0) {
        return NULL;
    }
    /* The view extends the module object: its extra fields start after the module's own,
     * whose size is only known here (the module object's layout is not public). */
    Py_ssize_t align = (Py_ssize_t)sizeof(void *);
    view_offset = (PyModule_Type.tp_basicsize + align - 1) / align * align;
    ModuleView_Type.tp_base = &PyModule_Type;
    ModuleView_Type.tp_basicsize = view_offset + (Py_ssize_t)sizeof(ViewExtra);
    if (PyType_Ready(&ModuleView_Type) < 0 || PyType_Ready(&ArmState_Type) < 0) {
        return NULL;
    }
    /* No instance namespace for the generic attribute code: `view_setattro` sends every
     * write to the module, but `object.__setattr__(view, ...)` skips it on Python 3.13
     * (which checks that call against the type's own `__setattr__` only when the target is
     * a type) and would write the view's own namespace. Without a dict offset the generic
     * code finds no namespace, so that write is refused (AttributeError) and
     * `object.__getattribute__(view, ...)` finds nothing. The module type's own code reads
     * its namespace through its own field, not this offset. PyType_Ready copies the
     * module type's offset, hence after it. */
    ModuleView_Type.tp_dictoffset = 0;
    PyType_Modified(&ModuleView_Type);
    PyObject *module = PyModule_Create(&fastimport_module);
    if (module == NULL) {
        return NULL;
    }
    if (the_state == NULL) {
        the_state = (PyObject *)PyObject_GC_New(ArmState, &ArmState_Type);
        if (the_state == NULL) {
            Py_DECREF(module);
            return NULL;
        }
        ArmState *st = (ArmState *)the_state;
        st->learn = Py_NewRef(Py_False);
        st->policy_name = PyUnicode_FromString("");
        st->trusted_roots = PyTuple_New(0);
        st->user_threads = PySet_New(NULL);
        st->sealed = 0;
        if (st->policy_name == NULL || st->trusted_roots == NULL || st->user_threads == NULL) {
            Py_DECREF(module);
            return NULL;
        }
        PyObject_GC_Track(the_state);
    }
    if (PyModule_AddType(module, &ModuleView_Type) < 0
        || PyModule_AddType(module, &ArmState_Type) < 0
        || PyModule_AddObjectRef(module, "state", the_state) < 0
        || PyModule_AddIntConstant(module, "VERSION", 2) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    PyObject *all = Py_BuildValue("[sssss]", "ArmState", "FastImport", "ModuleView", "VERSION",
                                  "state");
    if (PyModule_AddType(module, &FastImport_Type) < 0 || all == NULL
        || PyModule_AddObjectRef(module, "__all__", all) < 0) {
        Py_XDECREF(all);
        Py_DECREF(module);
        return NULL;
    }
    Py_DECREF(all);
    return module;
}
