#![allow(missing_docs, unsafe_code, clippy::all)]
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

use gpuledger_crds::GpuReservation;
use gpuledger_operator::ledger::index::trimmed;

struct Counting;
static CHUNK: AtomicI64 = AtomicI64::new(0);
static N: AtomicI64 = AtomicI64::new(0);
fn chunk(n: usize) -> i64 {
    (std::cmp::max(32, (n + 8 + 15) & !15)) as i64
}
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        CHUNK.fetch_add(chunk(l.size()), Ordering::Relaxed);
        N.fetch_add(1, Ordering::Relaxed);
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        CHUNK.fetch_sub(chunk(l.size()), Ordering::Relaxed);
        N.fetch_sub(1, Ordering::Relaxed);
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        CHUNK.fetch_add(chunk(n) - chunk(l.size()), Ordering::Relaxed);
        unsafe { System.realloc(p, l, n) }
    }
}
#[global_allocator]
static A: Counting = Counting;

fn json(i: usize) -> Vec<u8> {
    let uid = format!("5d0b{:04x}-1c2e-4b7a-9f3d-0a1b2c3d{:04x}", i, i);
    let gpu = format!(
        "GPU-0000{:04}-aaaa-bbbb-cccc-dddddddd{:04}",
        i / 20 % 5000,
        i % 8
    );
    let node = format!("node-{:05}", i / 20);
    format!(r#"{{"apiVersion":"gpuledger.io/v1alpha1","kind":"GpuReservation","metadata":{{"name":"pod-{i:06}","namespace":"gpuledger-bench","uid":"{uid}","resourceVersion":"{rv}","generation":1,"creationTimestamp":"2026-12-04T10:00:00Z","labels":{{"gpuledger.io/node":"{node}"}},"ownerReferences":[{{"apiVersion":"v1","kind":"Pod","name":"pod-{i:06}","uid":"{uid}","controller":false,"blockOwnerDeletion":false}}],"finalizers":["gpuledger.io/held-until-pod-ends"],"managedFields":[{{"manager":"gpuledger-operator","operation":"Update","apiVersion":"gpuledger.io/v1alpha1","time":"2026-12-04T10:00:00Z","fieldsType":"FieldsV1","fieldsV1":{{"f:spec":{{}}}}}}]}},
"spec":{{"podName":"pod-{i:06}","podUID":"{uid}","nodeName":"{node}","alignment":"none","alignmentSource":"default","containers":[{{"index":0,"name":"main","init":false,"devices":[{{"uuid":"{gpu}","memoryMiB":8192,"cores":10,"numaNode":0}}]}}],"initReleased":false}},
"status":{{"observedGeneration":1,"phase":"Allocated","phaseSince":"2026-12-04T10:00:01Z","devices":"{d}:8192/10","numa":"0",
"conditions":[{{"type":"Ready","status":"True","reason":"Allocated","message":"the pod's GPU containers hold the reserved GPUs","observedGeneration":1,"lastTransitionTime":"2026-12-04T10:00:01Z"}},{{"type":"Reconciling","status":"False","reason":"Allocated","message":"the pod's GPU containers hold the reserved GPUs","observedGeneration":1,"lastTransitionTime":"2026-12-04T10:00:01Z"}},{{"type":"Stalled","status":"False","reason":"Allocated","message":"the pod's GPU containers hold the reserved GPUs","observedGeneration":1,"lastTransitionTime":"2026-12-04T10:00:01Z"}}],
"allocation":[{{"index":0,"name":"main","replicaIds":["{gpu}-{rep}"],"devices":["{gpu}"],"allocatedAt":"2026-12-04T10:00:01Z"}}]}}}}"#, rv = 100000 + i, d = i % 8, rep = i % 10).into_bytes()
}

fn live() -> (i64, i64) {
    (CHUNK.load(Ordering::Relaxed), N.load(Ordering::Relaxed))
}

#[test]
fn scratch_mem() {
    const K: usize = 5000;
    let docs: Vec<Vec<u8>> = (0..K).map(json).collect();
    let (b0, n0) = live();
    let kept: Vec<Arc<GpuReservation>> = docs
        .iter()
        .map(|d| {
            Arc::new(trimmed(
                serde_json::from_slice::<GpuReservation>(d).unwrap(),
            ))
        })
        .collect();
    let (b1, n1) = live();
    eprintln!(
        "EXP whole: {} B/obj, {} allocs/obj; size_of GpuReservation {}",
        (b1 - b0) / K as i64,
        (n1 - n0) / K as i64,
        std::mem::size_of::<GpuReservation>()
    );
    let parts: Vec<(&str, Box<dyn Fn(&GpuReservation) -> Box<dyn std::any::Any>>)> = vec![
        (
            "metadata",
            Box::new(|r: &GpuReservation| Box::new(r.metadata.clone())),
        ),
        (
            "spec",
            Box::new(|r: &GpuReservation| Box::new(r.spec.clone())),
        ),
        (
            "status",
            Box::new(|r: &GpuReservation| Box::new(r.status.clone())),
        ),
        (
            "conditions",
            Box::new(|r: &GpuReservation| Box::new(r.status.as_ref().unwrap().conditions.clone())),
        ),
        (
            "allocation",
            Box::new(|r: &GpuReservation| Box::new(r.status.as_ref().unwrap().allocation.clone())),
        ),
        (
            "spec.containers",
            Box::new(|r: &GpuReservation| Box::new(r.spec.containers.clone())),
        ),
    ];
    for (name, f) in parts {
        let (a0, m0) = live();
        let v: Vec<Box<dyn std::any::Any>> = kept.iter().map(|r| f(r)).collect();
        let (a1, m1) = live();
        // minus the Box and Vec slot
        eprintln!(
            "EXP {name}: {} B/obj (incl. box), {} allocs/obj",
            (a1 - a0) / K as i64,
            (m1 - m0) / K as i64
        );
        drop(v);
    }
    drop(kept);
}
