//! Python exception classes under one `PagedrsError` base, and the mapping from core errors.

use pyo3::exceptions::{PyException, PyKeyError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

use pagedrs_core::Error;

static PAGEDRS_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static INVALID_REQUEST: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static OUT_OF_BLOCKS: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static RESIZE_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static UNKNOWN_REQUEST: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static POISONED: PyOnceLock<Py<PyType>> = PyOnceLock::new();

fn make_class<'py>(
    py: Python<'py>,
    name: &str,
    bases: &[Bound<'py, PyAny>],
    doc: &str,
) -> PyResult<Py<PyType>> {
    let ns = PyDict::new(py);
    ns.set_item("__module__", "pagedrs._core")?;
    ns.set_item("__doc__", doc)?;
    let ty = py.get_type::<PyType>();
    let cls = ty.call1((name, PyTuple::new(py, bases)?, ns))?;
    Ok(cls.cast_into::<PyType>()?.unbind())
}

/// Creates the classes and adds them to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let base = make_class(
        py,
        "PagedrsError",
        &[py.get_type::<PyException>().into_any()],
        "Base class of every pagedrs core error.",
    )?;
    let b = base.bind(py).clone().into_any();
    let value = py.get_type::<PyValueError>().into_any();
    let key = py.get_type::<PyKeyError>().into_any();
    let classes = [
        (&PAGEDRS_ERROR, base.clone_ref(py)),
        (
            &INVALID_REQUEST,
            make_class(
                py,
                "InvalidRequestError",
                &[b.clone(), value.clone()],
                "A bad value from the caller.",
            )?,
        ),
        (
            &OUT_OF_BLOCKS,
            make_class(
                py,
                "OutOfBlocksError",
                std::slice::from_ref(&b),
                "The pool cannot hold what is asked.",
            )?,
        ),
        (
            &RESIZE_ERROR,
            make_class(
                py,
                "ResizeError",
                &[b.clone(), value],
                "The pool cannot be resized as asked.",
            )?,
        ),
        (
            &POISONED,
            make_class(
                py,
                "SchedulerPoisonedError",
                std::slice::from_ref(&b),
                "A panic inside an earlier call left the scheduler unusable: restart the engine.",
            )?,
        ),
        (
            &UNKNOWN_REQUEST,
            make_class(py, "UnknownRequestError", &[b, key], "No such seq id.")?,
        ),
    ];
    for (cell, cls) in classes {
        let cls = cell.get_or_init(py, || cls).bind(py);
        m.add(cls.name()?, cls)?;
    }
    Ok(())
}

fn class<'py>(py: Python<'py>, cell: &PyOnceLock<Py<PyType>>) -> Bound<'py, PyType> {
    cell.get(py)
        .expect("pagedrs._core exception classes are registered")
        .bind(py)
        .clone()
}

/// The Python exception for a core error.
pub fn to_py(e: Error) -> PyErr {
    Python::attach(|py| {
        let cell = match &e {
            Error::InvalidConfig(_)
            | Error::InvalidRequest(_)
            | Error::EmptyPrompt { .. }
            | Error::DuplicateSeqId { .. }
            | Error::PromptTooLong { .. }
            | Error::PromptExceedsPool { .. }
            | Error::TokenOutOfRange { .. }
            | Error::PlanMismatch { .. }
            | Error::SampledLength { .. } => &INVALID_REQUEST,
            Error::UnknownSeqId { .. } => &UNKNOWN_REQUEST,
            Error::ResizeTooSmall { .. } | Error::Resize(_) => &RESIZE_ERROR,
            Error::OutOfBlocks { .. } => &OUT_OF_BLOCKS,
            Error::PlanPending { .. } | Error::StalePlan { .. } | Error::Invariant(_) => {
                &PAGEDRS_ERROR
            }
        };
        PyErr::from_type(class(py, cell), e.to_string())
    })
}

/// An InvalidRequestError with a message (argument checks done in the binding).
pub fn invalid(msg: String) -> PyErr {
    to_py(Error::InvalidRequest(msg))
}

/// A scheduler whose lock was poisoned by a panic in an earlier call: the engine must be restarted.
pub fn poisoned() -> PyErr {
    Python::attach(|py| {
        PyErr::from_type(
            class(py, &POISONED),
            "the scheduler panicked in an earlier call and its state cannot be trusted; restart the engine",
        )
    })
}
