//! Which objects a watch shows gone: the object of a `Delete` event, and — since a watch
//! that restarts relists instead of replaying what it missed — the objects the cache
//! held before a relist that the relist did not bring back (client-go's
//! "DeletedFinalStateUnknown"). The controller releases a deleted Service's VIP from
//! these, without a finalizer on the Service (docs/k8s-sync.md, "Deleted Services").
//!
//! Pure: fed the watch's events and, at the end of a relist, the cache as it was before
//! it; the caller sends what comes out to whoever acts on it.

use std::collections::HashSet;
use std::sync::Arc;

use kube::runtime::watcher::Event;
use kube::Resource;

/// Follows one watch's relists.
#[derive(Debug, Default)]
pub struct Departures {
    /// The uids a relist in progress has brought so far.
    relisting: Option<HashSet<String>>,
}

impl Departures {
    /// The objects `ev` shows gone. `before` is called only at the end of a relist and
    /// must return the cache as it was before that relist (so: call this before the
    /// event is applied to the cache). Objects are told apart by uid, so a Service
    /// deleted and created again under its name while the watch was down departs too.
    pub fn departed<K: Resource + Clone>(
        &mut self,
        ev: &Event<K>,
        before: impl FnOnce() -> Vec<Arc<K>>,
    ) -> Vec<Arc<K>> {
        match ev {
            Event::Delete(obj) => vec![Arc::new(obj.clone())],
            Event::Apply(_) => vec![],
            Event::Init => {
                self.relisting = Some(HashSet::new());
                vec![]
            }
            Event::InitApply(obj) => {
                if let (Some(seen), Some(uid)) = (self.relisting.as_mut(), obj.meta().uid.clone()) {
                    seen.insert(uid);
                }
                vec![]
            }
            Event::InitDone => {
                let Some(seen) = self.relisting.take() else {
                    return vec![];
                };
                before()
                    .into_iter()
                    .filter(|o| o.meta().uid.as_ref().is_some_and(|u| !seen.contains(u)))
                    .collect()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::Service;
    use kube::api::ObjectMeta;

    fn svc(name: &str, uid: &str) -> Service {
        Service {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("default".into()),
                uid: Some(uid.into()),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn names(v: &[Arc<Service>]) -> Vec<String> {
        v.iter()
            .map(|s| s.metadata.uid.clone().unwrap_or_default())
            .collect()
    }

    #[test]
    fn a_deleted_object_departs_an_updated_one_does_not() {
        let mut d = Departures::default();
        let never = || -> Vec<Arc<Service>> { panic!("no relist here") };
        assert!(d.departed(&Event::Apply(svc("a", "1")), never).is_empty());
        let gone = d.departed(&Event::Delete(svc("a", "1")), never);
        assert_eq!(names(&gone), ["1"]);
    }

    /// Deleted while the watch was down: the relist does not bring it back. A Service
    /// re-created under the same name has a new uid: the old one departs.
    #[test]
    fn a_relist_reports_what_it_no_longer_has() {
        let mut d = Departures::default();
        let before = vec![
            Arc::new(svc("kept", "1")),
            Arc::new(svc("deleted", "2")),
            Arc::new(svc("recreated", "3")),
        ];
        for ev in [
            Event::Init,
            Event::InitApply(svc("kept", "1")),
            Event::InitApply(svc("recreated", "4")),
            Event::InitApply(svc("new", "5")),
        ] {
            assert!(d.departed(&ev, || unreachable!()).is_empty());
        }
        let gone = d.departed(&Event::InitDone, || before.clone());
        assert_eq!(names(&gone), ["2", "3"]);
        // The relist is over: a second InitDone alone reports nothing.
        assert!(d.departed(&Event::InitDone, || before.clone()).is_empty());
    }

    /// The first list of a watch starts from an empty cache: nothing departs.
    #[test]
    fn the_first_list_departs_nothing() {
        let mut d = Departures::default();
        d.departed(&Event::<Service>::Init, Vec::new);
        d.departed(&Event::InitApply(svc("a", "1")), Vec::new);
        assert!(d
            .departed(&Event::InitDone, Vec::<Arc<Service>>::new)
            .is_empty());
    }
}
