//! Watches kept in local caches: the one watch pipeline the controller and the agent
//! share — the watch restarted with backoff after an error, and `managedFields` dropped
//! from every copy (never read here, and most of the bytes of the objects these
//! processes keep: copying and freeing them was the bulk of the agent's CPU at
//! thousands of Services).

use futures::Stream;
use kube::api::{Api, ResourceExt};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::Resource;

/// A kind of object kept in a cache (what the reflector needs of it).
pub trait Cached:
    Resource<DynamicType = ()>
    + Clone
    + serde::de::DeserializeOwned
    + std::fmt::Debug
    + Send
    + Sync
    + 'static
{
}

impl<K> Cached for K where
    K: Resource<DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static
{
}

/// The events of a watch of `api`, restarted with backoff, without `managedFields`.
pub fn watch<K>(
    api: Api<K>,
    wc: watcher::Config,
) -> impl Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    watcher(api, wc)
        .default_backoff()
        .modify(|o| o.managed_fields_mut().clear())
}

/// A cache of `api`'s objects ([`watch`] reflected into a store) and the events that
/// changed it: the stream must be polled to keep the store current.
pub fn reflect<K>(
    api: Api<K>,
    wc: watcher::Config,
) -> (
    Store<K>,
    impl Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
)
where
    K: Cached,
{
    let (store, writer) = reflector::store();
    (store, watch(api, wc).reflect(writer))
}
