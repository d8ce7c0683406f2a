//! `Client.route`'s arguments and answer in Python's terms: the hosts to
//! ask (named, or every host; each with the work queued there) and a dict
//! of what each holds of the request's prefix and what serving it costs.

use std::collections::HashMap;

use mooncake_proto::message::{RouteAnswer, RouteCandidate};
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// The hosts a route asks about: `candidates` (`None`: every host with a
/// live daemon) and every host `queues` names, each with its queue; and
/// whether every host is asked.
pub(super) fn candidates_of(
    candidates: Option<Vec<String>>,
    queues: Option<HashMap<String, u32>>,
) -> (Vec<RouteCandidate>, bool) {
    let queues = queues.unwrap_or_default();
    let every_host = candidates.is_none();
    let mut nodes = candidates.unwrap_or_default();
    for node in queues.keys() {
        if !nodes.contains(node) {
            nodes.push(node.clone());
        }
    }
    let asked: Vec<RouteCandidate> = nodes
        .into_iter()
        .map(|node| RouteCandidate {
            queue: queues.get(&node).copied().unwrap_or(0),
            node,
        })
        .collect();
    (asked, every_host)
}

/// A route's answer as a dict: `blocks`, `matched`, `best` (a node name
/// or `None`) and `hosts`, one dict each.
pub(super) fn answer_dict<'py>(
    py: Python<'py>,
    answer: &RouteAnswer,
) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    out.set_item("blocks", answer.blocks)?;
    out.set_item("matched", answer.matched)?;
    let best = answer.best.map(|i| answer.hosts[i as usize].node.clone());
    out.set_item("best", best)?;
    let hosts = answer
        .hosts
        .iter()
        .map(|h| {
            let d = PyDict::new(py);
            d.set_item("node", &h.node)?;
            d.set_item("instance", &h.instance)?;
            d.set_item("daemons", h.daemons)?;
            d.set_item("leading", h.leading)?;
            d.set_item("held", h.held)?;
            d.set_item("leading_nvme", h.leading_nvme)?;
            d.set_item("held_nvme", h.held_nvme)?;
            d.set_item("reads_per_sec", h.reads_per_sec)?;
            d.set_item("used", h.used)?;
            d.set_item("capacity", h.capacity)?;
            d.set_item("queue", h.queue)?;
            d.set_item("cost", h.cost_milli as f64 / 1000.0)?;
            Ok(d)
        })
        .collect::<PyResult<Vec<_>>>()?;
    out.set_item("hosts", hosts)?;
    Ok(out)
}
