//! A stand-in dataplane for the speaker's tests: the real status writer
//! (`juneau_control::dataplane_status`, the file protocol `juneau-dataplane` uses).

use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use juneau_control::dataplane_status::DataplaneStatusWriter;

/// A stand-in dataplane: the real status writer, heartbeating every 10 ms from a thread
/// (as the forwarding loop's housekeeping does).
pub struct FakeDataplane {
    writer: Arc<Mutex<Option<DataplaneStatusWriter>>>,
    stop: Arc<AtomicBool>,
    last_beat: Arc<Mutex<Instant>>,
    thread: Option<JoinHandle<()>>,
}

impl FakeDataplane {
    pub fn start(path: &std::path::Path) -> Result<Self> {
        let writer = Arc::new(Mutex::new(Some(DataplaneStatusWriter::create(path)?)));
        let stop = Arc::new(AtomicBool::new(false));
        let last_beat = Arc::new(Mutex::new(Instant::now()));
        let thread = {
            let (writer, stop, last_beat) = (writer.clone(), stop.clone(), last_beat.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if let Some(w) = writer.lock().unwrap().as_ref() {
                        w.heartbeat();
                        *last_beat.lock().unwrap() = Instant::now();
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
            })
        };
        Ok(FakeDataplane {
            writer,
            stop,
            last_beat,
            thread: Some(thread),
        })
    }

    /// Lists `vips` (IPv4 or IPv6) as programmed for state generation `generation`.
    pub fn program<V: Into<IpAddr> + Copy>(&self, generation: u64, vips: &[V]) -> Result<()> {
        self.writer
            .lock()
            .unwrap()
            .as_mut()
            .context("dataplane gone")?
            .publish(generation, vips.iter().copied())?;
        Ok(())
    }

    /// `kill -9`: the heartbeat stops, the file stays as it was (not marked stopped).
    /// Returns the instant of the last heartbeat.
    pub fn crash(mut self) -> Instant {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        // Leak the writer: a killed process runs no destructor.
        std::mem::forget(self.writer.lock().unwrap().take());
        let t = *self.last_beat.lock().unwrap();
        t
    }
}

impl Drop for FakeDataplane {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
